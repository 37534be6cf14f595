"""One device's interleaved 1F1B window (``_interleaved``): per tick a
forward slot (the stage of the table's repeat, its residuals written to the
table's ring slot), 1F1B's loss slot where the last repeat exits
(``_1f1b_tick``), a backward slot (the repeat's stage ``jax.vjp`` rebuilt
from its ring slot, its gradient accumulated at that repeat), the embedding's
backward where repeat 0 leaves the first device, and the circular neighbour
permutes."""

from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._pipeline._1f1b import initial_carry, make_window, window_results
from jaxaccum._pipeline._1f1b_tick import (
    Carry,
    Message,
    RingTicks,
    Window,
    axes_of,
    backward,
    device_cond,
    embed_backward,
    floats,
    forward,
    full_cotangent,
    loss_slot,
    own_sq,
    read_ring,
    stage_call,
    unshare,
)
from jaxaccum._pipeline._chunk_params import held, on_chunk, read, split
from jaxaccum._pipeline._device import (
    Device,
    Static,
    microbatch_key,
    select,
    varying,
)
from jaxaccum._pipeline._schedule import Tick
from jaxaccum._types import Batch
from jaxaccum._window._accum_dtypes import accum_dtype_for


class InterleavedTicks(RingTicks, Protocol):
    """What an interleaved window reads of its schedule (an
    ``_interleaved.Interleaved``: the protocol keeps this module below it):
    its slots, its ``Tables`` and the circular ring."""

    @property
    def num_stages(self) -> int: ...

    @property
    def repeats(self) -> int: ...

    @property
    def num_ticks(self) -> int: ...

    def tables(self) -> Any: ...

    def at(self, tick: Any, stage: Any) -> Tick: ...

    def backward_slot(self, tick: Any, stage: Any) -> Any: ...

    def forward_ring(self) -> list[tuple[int, int]]: ...

    def backward_ring(self) -> list[tuple[int, int]]: ...


def _ticks_of(device: Device) -> InterleavedTicks:
    return cast(InterleavedTicks, device.schedule)


def _chunks(device: Device) -> Device:
    """``device`` with its ``R`` chunks (:class:`Chunks`), each read whole
    by a stage slot's :func:`_on_chunk` (a slice of the ``(R, ...)`` stack
    taken at the tick's repeat would be copied every tick: XLA:CPU
    materialises a dynamic slice that feeds a dot). In device order the
    rows of the stack as given; in model order (relaid out, a copy
    already) split into ``R`` arrays before the loop."""
    repeats = _ticks_of(device).repeats
    own = device.own_stages
    if device.options.layout.stage_order == "device":
        return device._replace(own_stages=held(own, repeats))
    parts = tuple(
        jax.tree.map(lambda p, r=r: p[r : r + 1], own) for r in range(repeats)
    )
    return device._replace(own_stages=split(parts))


def _key(device: Device, index: Any, repeat: Any) -> Any:
    """The key of micro-batch ``index`` at model stage ``repeat S + d``."""
    layer = repeat * device.schedule.num_stages + device.stage
    return microbatch_key(device, index, layer)


def _on_chunk(device: Device, repeat: Any, fn: Any, *operands: Any) -> Any:
    """``fn(own, *operands)`` on the ``(1, ...)`` stage parameters of this
    device's ``repeat`` (:func:`~jaxaccum._pipeline._chunk_params.on_chunk`:
    a ``lax.switch`` whose branch reads its chunk at a static index, never
    a dynamic slice of the stack)."""
    axes = axes_of(device)

    def run(own: Any, *ops: Any) -> Any:
        return varying(fn(own, *ops), axes)

    return on_chunk(device.own_stages, repeat, run, *operands)


def _table(device: Device, name: str, tick: Any) -> jax.Array:
    """This device's entry of the ring slot table ``name`` at ``tick``."""
    table = getattr(_ticks_of(device).tables(), name)
    return jnp.asarray(table)[device.stage, tick]


def _forward_slot(window: Window, carry: Carry, tick_index: Any):
    """The tick's forward slot: the repeat's stage on the activation handed
    over (embedded here where the micro-batch enters), its residuals written
    to the table's ring slot. Returns the output, the ring and the Tick."""
    device, schedule = window.device, _ticks_of(window.device)
    tick = schedule.at(tick_index, device.stage)

    def embed():
        micro = device.batch.microbatch(tick.microbatch)
        layers = schedule.num_stages * schedule.repeats
        key = microbatch_key(device, tick.microbatch, layers)
        return varying(device.calls.embed(device.embed, micro, key), axes_of(device))

    entering = device_cond(device, tick.enters, embed, lambda: device.fill)
    x = select(tick.valid, select(tick.enters, entering, carry.incoming), device.fill)
    slot = _table(device, "forward_slot", tick_index)
    old = read_ring(carry.ring, slot)

    def chunk(own, key, x):
        y, saved, pullback = forward(stage_call(device), (own, key), x)
        window.pullback[:] = [pullback]
        return y, saved

    def run(key, x):
        return _on_chunk(device, tick.repeat, chunk, key, x)

    key = _key(device, tick.microbatch, tick.repeat)
    if window.skip:
        y, saved = device_cond(
            device, tick.valid, run, lambda *_: (device.fill, old), key, x
        )
    else:
        y, saved = run(key, x)
        saved = select(tick.valid, saved, old)
    ring = [
        lax.dynamic_update_index_in_dim(r, s, slot, 0)
        for r, s in zip(carry.ring, saved, strict=True)
    ]
    return y, ring, tick


def _added_at(total: Any, grad: Any, factor: Any, repeat: Any) -> Any:
    """``total[repeat] += grad[0] * factor`` leaf by leaf, in ``total``'s
    dtypes (``grad`` a ``(1, ...)`` slice's gradient)."""

    def add(t: jax.Array, g: jax.Array) -> jax.Array:
        old = lax.dynamic_slice_in_dim(t, repeat, 1, 0)
        new = old + (g.astype(t.dtype) * factor).astype(t.dtype)
        return lax.dynamic_update_slice_in_dim(t, new, repeat, 0)

    return jax.tree.map(add, total, grad)


def _backward_slot(window: Window, carry: Carry, ring: list, message, t: Any):
    """The tick's backward slot: the table's (micro-batch, repeat) stage
    backward from its ring slot, accumulated at the repeat; where repeat 0
    leaves the first device the embedding's. Returns the gradients, the
    message to the stage before and the stage's and embedding's squared
    norms."""
    device = window.device
    slot = _ticks_of(device).backward_slot(t, device.stage)
    valid, index, repeat = slot
    saved = read_ring(ring, _table(device, "backward_slot", t))
    embed_grad, stage_grad, head_grad = carry.grads
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))

    def chunk(own, key, saved, cotangent):
        (own_grad, _), dx = backward(window.pullback[0], (own, key), saved, cotangent)
        return own_grad, dx

    def run(stage_grad, saved, message):
        cotangent = full_cotangent(device.fill, message.cotangent)
        key = _key(device, index, repeat)
        own_grad, dx = _on_chunk(device, repeat, chunk, key, saved, cotangent)
        accum = device.options.accum_dtype
        grad = jax.tree.map(
            lambda g: g.astype(accum_dtype_for(g.dtype, accum)), own_grad
        )
        sq = own_sq(window, grad, message.share) if window.probed else zero
        grad = jax.tree.map(lambda g: jnp.where(valid, g, 0), grad)
        factor = unshare(window, message.share)
        stage_grad = _added_at(stage_grad, grad, factor, repeat)
        dx = [jnp.where(valid, g, 0) for g in floats(dx)]
        return stage_grad, Message(dx, jnp.where(valid, message.share, 0)), sq

    def idle(stage_grad, saved, message):
        none = jnp.zeros_like(message.share)
        return stage_grad, Message(message.cotangent, none), zero

    if window.skip:
        stage_grad, back, stage_sq = device_cond(
            device, valid, run, idle, stage_grad, saved, message
        )
    else:
        stage_grad, back, stage_sq = run(stage_grad, saved, message)
    first = valid & (repeat == 0)
    embed_grad, embed_sq = embed_backward(window, embed_grad, back, index, first)
    return (embed_grad, stage_grad, head_grad), back, (embed_sq, stage_sq)


def _one_tick(window: Window, carry: Carry, tick_index: Any):
    """One tick of one device: its forward slot, the loss where the last
    repeat exits, its backward slot (seeded by that loss on the last device
    in the last repeat, else by the cotangent handed back round the ring);
    the activation handed on, the cotangent handed back."""
    device, schedule = window.device, _ticks_of(window.device)
    y, ring, tick = _forward_slot(window, carry, tick_index)
    head_grad, sums, out, message, head_sq = loss_slot(window, carry, y, tick)
    repeat = schedule.backward_slot(tick_index, device.stage).repeat
    seeded = (device.stage == schedule.num_stages - 1) & (
        repeat == schedule.repeats - 1
    )
    message = select(seeded, message, carry.back)
    carry = carry._replace(grads=(*carry.grads[:2], head_grad), sums=sums)
    grads, back, (embed_sq, stage_sq) = _backward_slot(
        window, carry, ring, message, tick_index
    )
    axis = device.options.layout.stage_axis
    incoming = lax.ppermute(y, axis, schedule.forward_ring())
    back = lax.ppermute(back, axis, schedule.backward_ring())
    per_tick = (out.loss, out.weight, embed_sq, stage_sq, head_sq)
    return Carry(incoming, back, ring, grads, sums), per_tick


def run_window(
    static: Static, skip: bool, params: tuple, batch: Batch, key: Any, loss_scale: Any
):
    """One device's interleaved window under ``shard_map``; returns what the
    1F1B window's ``run_window`` does."""
    options = static.options
    schedule = cast(InterleavedTicks, static.schedule)
    window = make_window(static, skip, params, batch, key, loss_scale)
    window = window._replace(device=_chunks(window.device))
    # a stage of repeat 0: the ring's slots
    first = (read(window.device.own_stages, 0), _key(window.device, 0, 0))
    carry, per_tick = lax.scan(
        lambda c, t: _one_tick(window, c, t),
        initial_carry(window, static.shapes, first),
        jnp.arange(schedule.num_ticks),
        unroll=options.unroll,
    )
    return window_results(carry, per_tick, schedule, static.fsdp_dims, options)
