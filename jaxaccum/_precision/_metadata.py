"""Leaves that are not gradients: FP8 metadata, combined across a window by max.

Flax's delayed-scaling FP8 layers (``flax.linen.fp8_ops``) keep amax histories
and scales in the ``_overwrite_with_gradient`` collection; their "gradient" is
their new value (the history rolled by one, its first entry the current
batch's amax), which ``TrainState.apply_gradients`` writes over the old one.
Two such values combine by max (Flax's own ``fm32`` dtype says so), so across
the micro-batches of a window, its devices and its calls they are maxed, never
reduced as gradients: every micro-batch starts from the window's values, so
the max is the big batch's new value.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._types import PyTree

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # Flax's collection


def _is_fp8_meta_dtype(dtype: Any) -> bool:
    """Flax's ``fm32`` (an extended dtype over float32 whose sum is a max)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and hasattr(
        dtype, "float_dtype"
    )


def _names(path: Sequence[Any]) -> list[Any]:
    return [getattr(key, "key", getattr(key, "name", None)) for key in path]


def is_metadata(path: Sequence[Any], leaf: PyTree) -> bool:
    """Whether a gradient leaf is FP8 metadata (combined by max): under the
    ``_overwrite_with_gradient`` collection, or of Flax's ``fm32`` dtype."""
    dtype = getattr(leaf, "dtype", None)
    in_collection = OVERWRITE_WITH_GRADIENT in _names(path)
    return in_collection or (dtype is not None and _is_fp8_meta_dtype(dtype))


def metadata_flags(tree: PyTree) -> tuple[bool, ...]:
    """Per leaf of ``tree`` (flattened), whether it is FP8 metadata."""
    return tuple(
        is_metadata(path, leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    )


def gradient_leaves(tree: PyTree) -> list[Any]:
    """The leaves of a gradient-shaped ``tree`` that are gradients, FP8
    metadata left out: what a squared norm or an error norm sees."""
    return [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if not is_metadata(path, leaf)
    ]


def physical(x: PyTree) -> jax.Array:
    """A metadata value as the float array it is stored as (``fm32``: float32)."""
    x = jnp.asarray(x)
    if _is_fp8_meta_dtype(x.dtype):
        return lax.convert_element_type(x, x.dtype.float_dtype)
    return x


def physical_dtype(dtype: Any) -> Any:
    return dtype.float_dtype if _is_fp8_meta_dtype(dtype) else dtype


def as_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """A float metadata value back in its leaf's dtype (``fm32`` included)."""
    return lax.convert_element_type(x, dtype)


def lowest(aval: Any) -> jax.Array:
    """The identity of max for a metadata leaf: -inf, in its float dtype."""
    dtype = physical_dtype(aval.dtype)
    return jnp.full(aval.shape, -jnp.inf, dtype)
