"""Pass 2: each micro-batch's forward again, and the pullback of its slice of
the whole-batch cotangent, summed over the micro-batches in one scan."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._cached._library import (
    CachedWindow,
    accum_dtype_for,
    strided_view,
    take_microbatch,
    zeros_like_aval,
)
from jaxaccum._cached._roles import Encoder
from jaxaccum._types import PyTree


def pull_back(
    encode_at: Encoder,
    diff: tuple,
    window: CachedWindow,
    cotangents: PyTree,
    *,
    accum_dtype: Any,
    unroll: int | bool,
    varying: Callable[[tuple], tuple] = lambda sums: sums,
) -> tuple:
    """The sum over micro-batches of the encoder's pullbacks, in
    ``accum_dtype`` (at least), shaped like ``diff``.

    Micro-batch ``k`` draws the keys pass 1 drew (the window's), so its
    forward is pass 1's; its cotangent rows ``k, k + N, ...`` are column
    ``k`` of the cotangents' strided view, as its examples are the batch's.
    A cotangent meets the pullback cast to its output's dtype. ``varying``
    types the zero sums as the gradients are typed per device (the window
    per device's sums differ between devices).
    """
    num = window.num_microbatches
    views = [
        strided_view(ct, num) if jnp.issubdtype(ct.dtype, jnp.inexact) else None
        for ct in jax.tree.leaves(cotangents)
    ]

    def micro_cotangent(outputs: PyTree, index: jax.Array) -> PyTree:
        leaves, treedef = jax.tree.flatten(outputs)
        cts = [
            np.zeros(out.shape, jax.dtypes.float0)
            if view is None
            else take_microbatch(view, index).astype(out.dtype)
            for out, view in zip(leaves, views, strict=True)
        ]
        return jax.tree.unflatten(treedef, cts)

    def body(sums: tuple, xs: tuple) -> tuple[tuple, None]:
        index, micro_keys = xs
        micro_batch = window.microbatch(index)
        with jax.named_scope("jaxaccum_cached_pullback"):
            outputs, pullback = jax.vjp(
                lambda d: encode_at(d, micro_batch, micro_keys), diff
            )
            (grads,) = pullback(micro_cotangent(outputs, index))
        sums = jax.tree.map(lambda s, g: s + g.astype(s.dtype), sums, grads)
        return sums, None

    zeros = varying(
        jax.tree.map(
            lambda x: zeros_like_aval(
                jax.typeof(x), accum_dtype_for(jnp.result_type(x), accum_dtype)
            ),
            diff,
        )
    )
    sums, _ = lax.scan(body, zeros, (jnp.arange(num), window.keys), unroll=unroll)
    return sums
