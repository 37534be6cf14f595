"""Pass 1: the encoder forward over the micro-batches in one scan, keeping
nothing but its per-example outputs, put back in the batch's order."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._cached._library import CachedWindow
from jaxaccum._cached._roles import Encoder
from jaxaccum._types import PyTree

# Names of mutable statistics in the encoder's outputs (Flax Linen's
# collection; an NNX or Equinox BatchNorm's layer name).
_STATE_NAMES = ("batch_stats", "BatchNorm")


def encode_window(
    encode_at: Encoder, diff: tuple, window: CachedWindow, unroll: int | bool
) -> PyTree:
    """The encoder's outputs on the whole batch, row ``j`` example ``j``.

    Micro-batch ``k`` holds examples ``k, k + N, ...``, so the scan's stacked
    outputs ``(N, B // N, ...)`` are the batch's once their first two axes
    are swapped: a copy of the outputs (``B x D``), never of the batch.

    Raises:
      ValueError: naming the output leaf that has no leading axis of the
        micro-batch's rows (or that is mutable state, as BatchNorm's).
    """

    def body(carry: None, xs: tuple) -> tuple[None, PyTree]:
        index, micro_keys = xs
        with jax.named_scope("jaxaccum_cached_encode"):
            return carry, encode_at(diff, window.microbatch(index), micro_keys)

    num = window.num_microbatches
    _, stacked = lax.scan(body, None, (jnp.arange(num), window.keys), unroll=unroll)
    check_outputs(stacked, window)
    return jax.tree.map(
        lambda x: jnp.swapaxes(x, 0, 1).reshape(num * x.shape[1], *x.shape[2:]),
        stacked,
    )


def check_outputs(stacked: PyTree, window: CachedWindow) -> None:
    """Every leaf of the encoder's outputs (stacked over the micro-batches) is
    an array whose leading axis is the micro-batch's rows."""
    rows = window.microbatch_size
    for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
        name = "outputs" + jax.tree_util.keystr(path)
        shape = np.shape(leaf)[1:]
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
