"""Pass 1: the encoder forward over the micro-batches in one scan, keeping
nothing but its per-example outputs, written in the batch's order."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun

from jaxaccum._cached._library import CachedWindow, explicit_sharding, strided_view
from jaxaccum._cached._roles import Encoder
from jaxaccum._types import PyTree

# Names of mutable statistics in the encoder's outputs (Flax Linen's
# collection; an NNX or Equinox BatchNorm's layer name).
_STATE_NAMES = ("batch_stats", "BatchNorm")


def encode_window(
    encode_at: Encoder, diff: tuple, window: CachedWindow, unroll: int | bool
) -> PyTree:
    """The encoder's outputs on the whole batch, row ``j`` example ``j``.

    Micro-batch ``k`` holds examples ``k, k + N, ...``: the scan writes its
    outputs into column ``k`` of a ``(B // N, N, ...)`` buffer per output
    leaf, which is the batch's ``(B, ...)`` by a reshape. Nothing but the
    outputs is kept (no stacked copy to reorder: ``B x D`` less per
    output leaf than stacking them and swapping the axes).

    Raises:
      ValueError: naming the output leaf that has no leading axis of the
        micro-batch's rows (or that is mutable state, as BatchNorm's).
    """

    def encode(index: jax.Array, micro_keys: tuple) -> PyTree:
        with jax.named_scope("jaxaccum_cached_encode"):
            return encode_at(diff, window.microbatch(index), micro_keys)

    num = window.num_microbatches
    indices = jnp.arange(num)
    # Traced once, at one micro-batch's types: the outputs' types size the
    # columns, and the scan's body evaluates the same program.
    one = jax.tree.map(
        lambda k: jax.ShapeDtypeStruct(k.shape[1:], k.dtype), window.keys
    )
    index = jax.ShapeDtypeStruct((), indices.dtype)
    program, shapes = jax.make_jaxpr(encode, return_shape=True)(index, one)
    check_outputs(shapes, window)
    outputs_tree, run = jax.tree.structure(shapes), jaxpr_as_fun(program)

    def body(columns: list, xs: tuple) -> tuple[list, None]:
        outputs = run(*jax.tree.leaves(xs))
        columns = [
            lax.dynamic_update_index_in_dim(column, out, xs[0], 1)
            for column, out in zip(columns, outputs, strict=True)
        ]
        return columns, None

    empty = [_columns(aval, num) for aval in program.out_avals]
    columns, _ = lax.scan(body, empty, (indices, window.keys), unroll=unroll)
    rows = [c.reshape(num * c.shape[0], *c.shape[2:]) for c in columns]
    return jax.tree.unflatten(outputs_tree, rows)


def _columns(aval: Any, num: int) -> jax.Array:
    """Zeros of an output's ``(rows, ...)`` type with an axis of ``num``
    columns after its rows: the strided view of ``rows N`` zeros (sharded as
    the output under an Explicit mesh), varying over the manual axes the
    output varies over (a device's window)."""
    shape = (aval.shape[0] * num, *aval.shape[1:])
    zeros = jnp.zeros(shape, aval.dtype, out_sharding=explicit_sharding(aval))
    (columns,) = strided_view([zeros], num)
    varying = tuple(sorted(aval.manual_axis_type.varying))
    return lax.pcast(columns, varying, to="varying") if varying else columns


def check_outputs(outputs: PyTree, window: CachedWindow) -> None:
    """Every leaf of the encoder's outputs on one micro-batch (their shapes)
    is an array whose leading axis is the micro-batch's rows."""
    rows = window.microbatch_size
    for path, leaf in jax.tree_util.tree_leaves_with_path(outputs):
        name = "outputs" + jax.tree_util.keystr(path)
        shape = np.shape(leaf)
        if any(state in name for state in _STATE_NAMES):
            raise ValueError(
                f"encode returns {name}, mutable state: cached_value_and_grad "
                "refuses an encoder with mutable state, because BatchNorm's "
                "statistics over each micro-batch are not the big batch's, so "
                "no accumulation gives the big batch's gradient. Use LayerNorm "
                "or GroupNorm, or BatchNorm with its running averages "
                "(use_running_average=True, nothing mutable)."
            )
        if not shape or shape[0] != rows:
            raise ValueError(
                f"encode's output {name} has shape {shape} on a micro-batch of "
                f"{rows} examples: every output leaf needs a leading axis of "
                "the micro-batch's rows (one output per example), which the "
                "loss sees concatenated over the whole batch. Return per-batch "
                "values as per-example ones (broadcast, or compute them in "
                "loss), or pass them to loss as a non-batch argument."
            )
