"""The dtypes a window sums in, and its zeros (sharded like what they sum)."""

from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._window._split import explicit_sharding


def accum_dtype_for(dtype: Any, accum_dtype: Any) -> Any:
    """Float leaves accumulate in at least ``accum_dtype``; others as they are."""
    if accum_dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.promote_types(dtype, accum_dtype)


def sum_dtype(dtype: Any, accum_dtype: Any) -> Any:
    """The dtype a window sums a scalar in (its loss, its weights or token
    counts): integers exactly, in at least int32 (bool counts as int32);
    floats in at least float32 and ``accum_dtype``, whatever the gradients'
    dtype (a float16 sum of 160k tokens is inf)."""
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.dtype(jnp.int32)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.int32)
    return jnp.promote_types(accum_dtype_for(dtype, accum_dtype), jnp.float32)


def zeros_like_aval(aval: Any, dtype: Any) -> jax.Array:
    """Zeros like ``aval``, sharded like it under an Explicit mesh.

    There a scan carry's type includes its sharding, so an accumulator must start
    sharded as the gradient it sums (e.g. a parameter sharded over a model axis).
    """
    return jnp.zeros(aval.shape, dtype, out_sharding=explicit_sharding(aval))
