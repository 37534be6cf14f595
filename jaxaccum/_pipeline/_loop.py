"""One device's GPipe (or circular) window under ``shard_map``, backward
by autodiff through it: the first stage embeds every
micro-batch, the ticks run (activations handed on by ``ppermute``,
recirculated for ``repeats > 1``), the last stage takes every loss."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._noise_scale import unscaled_squared_norm
from jaxaccum._pipeline._calls import LossOut
from jaxaccum._pipeline._device import (
    Device,
    Probes,
    Static,
    make_device,
    microbatch_key,
    select,
    varying,
)
from jaxaccum._types import Batch, Fun, PyTree


@jax.custom_vjp
def _probe(tree: PyTree, probe: jax.Array) -> PyTree:
    """``tree`` unchanged; in the backward pass the cotangent of ``probe``
    is the float32 squared norm of ``tree``'s divided by ``probe``'s value
    (the loss scale, or 1) before squaring (``report_stats``)."""
    del probe
    return tree


def _probe_fwd(tree: PyTree, probe: jax.Array) -> tuple[Any, jax.Array]:
    return tree, probe


def _probe_bwd(probe: jax.Array, cotangent: PyTree) -> tuple[Any, jax.Array]:
    return cotangent, jnp.zeros_like(probe) + unscaled_squared_norm(cotangent, probe)


_probe.defvjp(_probe_fwd, _probe_bwd)


class _Carry(NamedTuple):
    """The scan carry of a device.

    Attributes:
      incoming: the activation the previous stage's device handed over.
      waiting: with ``R > 1`` and ``M > S``, activations that left the last
        stage, waiting for the first stage's next repeat (a ring buffer of
        ``M - S``), else ``()``.
    """

    incoming: PyTree
    waiting: PyTree


def _map(fn: Fun, xs: tuple, unroll: int | bool) -> PyTree:
    """``fn(*x)`` for each ``x`` of ``xs`` (split on axis 0), stacked: a scan."""
    return lax.scan(lambda _, x: (None, fn(*x)), None, xs, unroll=unroll)[1]


def _embedded(device: Device, probes: jax.Array | None) -> PyTree:
    """``(M, ...)``: every micro-batch embedded, on the first stage's device
    (the fill elsewhere), before the loop: one conditional per window."""
    num, schedule = device.schedule.num_microbatches, device.schedule
    layers = schedule.num_stages * schedule.repeats

    def embed_one(index, probe):
        params = device.embed if probe is None else _probe(device.embed, probe)
        micro = device.batch.microbatch(index)
        return device.calls.embed(params, micro, microbatch_key(device, index, layers))

    def embed_all():
        out = _map(embed_one, (jnp.arange(num), probes), device.options.unroll)
        return varying(out, device.options.layout.manual_axes)

    fills = _repeated(device.fill, num)
    return lax.cond(device.stage == 0, embed_all, lambda: fills)


def _losses(device: Device, leaving: Any, probes: jax.Array | None) -> LossOut:
    """Each micro-batch's :class:`LossOut` (stacked), from its activation
    leaving the last stage, on the last stage's device (zeros elsewhere),
    after the loop: one conditional per window."""
    num, schedule = device.schedule.num_microbatches, device.schedule
    layers = schedule.num_stages * schedule.repeats

    def loss_one(index, x, probe):
        params = device.head if probe is None else _probe(device.head, probe)
        micro = device.batch.microbatch(index)
        key = microbatch_key(device, index, layers + 1)
        return device.calls.loss(params, x, micro, key)

    def loss_all():
        xs = (jnp.arange(num), leaving, probes)
        out = _map(loss_one, xs, device.options.unroll)
        return varying(out, device.options.layout.manual_axes)

    zeros = _repeated(device.no_loss, num)
    return lax.cond(device.stage == schedule.num_stages - 1, loss_all, lambda: zeros)


def _recirculated(device: Device, carry: _Carry, tick_index: jax.Array):
    """The activation that left the last stage ``M`` iterations ago (the
    first stage's input for its next repeat), and the updated buffer."""
    delay = device.schedule.recirculation_delay
    if delay == 0:
        return carry.incoming, carry.waiting
    slot = tick_index % delay
    out = jax.tree.map(
        lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), carry.waiting
    )
    waiting = jax.tree.map(
        lambda b, x: lax.dynamic_update_index_in_dim(b, x, slot, 0),
        carry.waiting,
        carry.incoming,
    )
    return out, waiting


def _tick(device: Device, carry: _Carry, xs: tuple) -> tuple[_Carry, Any]:
    """One tick of one device: its stage on its input (the fill in a
    bubble), the result handed to the next stage's device; returns the
    result where a micro-batch leaves the last stage (the fill elsewhere)."""
    tick_index, entering, probe = xs
    schedule = device.schedule
    tick = schedule.at(tick_index, device.stage)
    first, waiting = entering, carry.waiting
    if schedule.repeats > 1:
        recirculated, waiting = _recirculated(device, carry, tick_index)
        first = select(tick.repeat == 0, entering, recirculated)
    x = select(device.stage == 0, first, carry.incoming)
    x = select(tick.valid, x, device.fill)
    with jax.named_scope("jaxaccum_pipeline_stage"):
        key = microbatch_key(device, tick.microbatch, tick.layer)
        y = device.calls.stage(
            device.stages, device.own_stages, tick.repeat, tick.valid, probe, x, key
        )
    num = schedule.num_stages
    ring = [(d, d + 1) for d in range(num - 1)]
    if schedule.repeats > 1:
        ring.append((num - 1, 0))
    incoming = lax.ppermute(y, device.options.layout.stage_axis, ring)
    return _Carry(incoming, waiting), select(tick.exits, y, device.fill)


def _repeated(tree: PyTree, count: int) -> PyTree:
    """``tree``'s leaves stacked ``count`` times on a new axis 0."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), tree)


def _run_ticks(device: Device, entering: Any, probes: jax.Array | None) -> PyTree:
    """The loop: ``T`` ticks; returns ``(M, ...)``, each micro-batch's
    activation as it left the last stage (on the last stage's device).

    Entering and leaving activations are the scan's inputs and outputs,
    indexed by tick, not buffers indexed by micro-batch in the carry (whose
    transposes would add a whole buffer per tick).
    """
    schedule, num = device.schedule, device.schedule.num_microbatches
    ticks = schedule.num_ticks
    pad = _repeated(device.fill, ticks - num)
    entering = jax.tree.map(lambda e, p: jnp.concatenate([e, p]), entering, pad)
    delay = schedule.recirculation_delay
    fill = device.fill
    waiting = _repeated(fill, delay) if delay else ()
    _, leaving = lax.scan(
        functools.partial(_tick, device),
        _Carry(fill, waiting),
        (jnp.arange(ticks), entering, probes),
        unroll=device.options.unroll,
    )
    first_exit = num * (schedule.repeats - 1) + schedule.num_stages - 1
    return jax.tree.map(lambda y: y[first_exit : first_exit + num], leaving)


def on_device(
    static: Static, params: tuple, probes: Probes | None, batch: Batch, key: Any
) -> tuple[jax.Array, tuple[LossOut, LossOut]]:
    """One device's window under ``shard_map``.

    Returns the loss sum (differentiated), and the :class:`LossOut` summed
    over micro-batches and devices and, per micro-batch, the loss and weight
    (``(1, 1, M)`` per device, for the stats).
    """
    axes = static.options.layout.manual_axes
    device = make_device(static, params, batch, key)
    if probes is not None:
        probes = jax.tree.map(lambda p: p.reshape(-1), probes)
    entering = _embedded(device, None if probes is None else probes.embed)
    leaving = _run_ticks(device, entering, None if probes is None else probes.stage)
    per_micro = _losses(device, leaving, None if probes is None else probes.head)
    sums = lax.psum(jax.tree.map(lambda x: jnp.sum(x, 0), per_micro), axes)
    per_micro = per_micro._replace(aux=())
    per_micro = jax.tree.map(lambda y: y.reshape(1, 1, *y.shape), per_micro)
    return sums.loss, (sums, per_micro)
