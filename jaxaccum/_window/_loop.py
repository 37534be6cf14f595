"""The window's loop: the micro-batches in one ``lax.scan`` over a strided view
of the batch (or one micro-batch, no scan), masked ones skipped."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._types import Fun, PyTree
from jaxaccum._window import _split
from jaxaccum._window._accum_dtypes import zeros_like_aval
from jaxaccum._window._call_checks import check_state
from jaxaccum._window._micro_result import MicroResult
from jaxaccum._window._microbatch import (
    Inputs,
    gathered,
    microbatch_keys,
    window_num_means,
)
from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._window import Window, WindowOut


def make_window(
    result_shape: MicroResult,
    inputs: Inputs,
    options: WindowSpec,
    split: _split.Split,
) -> Window:
    """The window of both paths, once the state ``fun`` returns is checked."""
    check_state(inputs.state, result_shape.out.new_state, options.state_nums)
    return Window(result_shape, options, split, inputs.loss_scale)


def run_single(
    micro: Callable[..., MicroResult],
    inputs: Inputs,
    options: WindowSpec,
    split: _split.Split,
) -> WindowOut:
    """One micro-batch, no scan, the key passed unchanged: jax.value_and_grad."""
    result = micro(
        gathered(inputs.diff, options),
        inputs.batch,
        inputs.keys,
        inputs.state,
        inputs.example_mask,
        window_num_means(options, 1),
    )
    window = make_window(jax.eval_shape(lambda: result), inputs, options, split)
    sums, stacked = window.add(window.zeros(), result)
    micro_stats = window.micro_stats(result, inputs.example_mask)
    return WindowOut(
        window.result(sums, [x[None] for x in stacked]),
        result.out.new_state,
        jax.tree.map(lambda x: x[None], micro_stats),
    )


def run_scan(
    micro: Callable[..., MicroResult],
    inputs: Inputs,
    options: WindowSpec,
    split: _split.Split,
) -> WindowOut:
    """The micro-batches in one scan over a strided view of the batch."""
    num = split.num_microbatches
    batch = _split.strided_batch(inputs.batch, num)
    mask_view = None
    if inputs.example_mask is not None:
        mask_view = _split.strided_view(inputs.example_mask, num)
    keys = microbatch_keys(inputs.keys, num)

    def mask_at(index):
        return None if mask_view is None else _split.take_microbatch(mask_view, index)

    num_means = window_num_means(
        options, num if inputs.active is None else inputs.active
    )

    def micro_at(index, micro_keys, state, mask):
        micro_batch = batch.microbatch(index)
        diff = gathered(inputs.diff, options, index)
        return micro(diff, micro_batch, micro_keys, state, mask, num_means)

    first_keys = jax.tree.map(lambda k: k[0], keys)
    first = jnp.zeros((), jnp.int32)
    result_shape = jax.eval_shape(
        micro_at, first, first_keys, inputs.state, mask_at(first)
    )
    window = make_window(result_shape, inputs, options, split)

    def body(carry, xs):
        sums, state = carry
        index, micro_keys = xs
        mask = mask_at(index)
        result = micro_at(index, micro_keys, state, mask)
        sums, stacked = window.add(sums, result)
        micro_stats = window.micro_stats(result, mask)
        return (sums, result.out.new_state), (stacked, micro_stats)

    carry = (window.zeros(), inputs.state)
    if inputs.active is not None:
        body = skip_inactive(body, carry, (first, first_keys), inputs.active)
    (sums, state), (stacked, micro_stats) = lax.scan(
        body, carry, (jnp.arange(num), keys), unroll=options.unroll
    )
    result = window.result(sums, stacked, num_active=inputs.active)
    return WindowOut(result, state, micro_stats)


def skip_inactive(body: Fun, carry: PyTree, xs: PyTree, active: jax.Array) -> Fun:
    """``body`` for micro-batches below ``active``; above it, the carry
    unchanged and zeros out (weight 0, finite), not computed."""
    out_shape = jax.eval_shape(body, carry, xs)[1]

    def skipped(carry, xs):
        del xs
        # Sharded like the computed branch's outputs under an Explicit mesh.
        zeros = jax.tree.map(lambda aval: zeros_like_aval(aval, aval.dtype), out_shape)
        stacked, micro_stats = zeros
        finite = jnp.ones_like(micro_stats.finite)
        return carry, (stacked, micro_stats._replace(finite=finite))

    def masked_body(carry, xs):
        return lax.cond(xs[0] < active, body, skipped, carry, xs)

    return masked_body
