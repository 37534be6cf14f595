"""One device's V-shaped zero-bubble window (``_v_shape``), tick by tick on
its tables (``_v_tables``): the one op the tables give it, of its down
chunk (model stage ``d``, repeat 0 of its stacked stages) or its up chunk
(stage ``2 S - 1 - d``, repeat 1):
an F (the chunk's stage on the inbox's activation, embedded on device 0's
down chunk; its residuals to the ring; the loss after device 0's up chunk,
its cotangent handed to itself), a B (zero-bubble's input half,
``_zero_bubble_split``: the input's cotangent handed on, the boundary
stored; the embedding's backward after device 0's down chunk) or a W (the
weight half, accumulated at the chunk). Each tick's F output and B
cotangent go both ways by four neighbour permutes (at the V's tip and for
the loss, a device hands them to itself), written into the inbox slots the
tables give their arrival. Then the W's after the last F and B, without
permutes. The device's two stages are split before the loop and each op
reads its chunk's whole, in a ``lax.switch``."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._pipeline._1f1b import initial_carry, make_window, window_results
from jaxaccum._pipeline._1f1b_tick import (
    Message,
    RingTicks,
    Window,
    axes_of,
    device_cond,
    embed_backward,
    forward,
    loss_slot,
    own_sq,
    read_ring,
    stage_call,
    unshare,
)
from jaxaccum._pipeline._chunk_params import held, on_chunk, read, split
from jaxaccum._pipeline._device import Device, Static, microbatch_key, select, varying
from jaxaccum._pipeline._schedule import Tick
from jaxaccum._pipeline._v_tables import VTables
from jaxaccum._pipeline._zero_bubble_split import weight_part
from jaxaccum._pipeline._zero_bubble_tick import Halves, input_half, loops, split_stage
from jaxaccum._types import Batch
from jaxaccum._window._accum_dtypes import accum_dtype_for


class VTicks(RingTicks, Protocol):
    """What a V window reads of its schedule (a ``_v_shape.VShape``: the
    protocol keeps this module below it)."""

    @property
    def num_stages(self) -> int: ...

    @property
    def loop_ticks(self) -> int: ...

    @property
    def num_ticks(self) -> int: ...

    def tables(self) -> VTables: ...

    def at(self, tick: Any, stage: Any) -> Tick: ...


def _ticks_of(device: Device) -> VTicks:
    return cast(VTicks, device.schedule)


class Carry(NamedTuple):
    """A device's scan carry.

    Attributes:
      ring: per saved residual, its ``(K, ...)`` slots.
      inbox: the activations waiting for their F, ``(I, ...)`` slots (what
        was handed to it written there at the end of the tick it was sent).
      back: the :class:`Message` s waiting for their B.
      stored: B's boundaries and shares waiting for their W.
      grads: ``(embed, stages, head)`` gradients, the stages ``(2, ...)``.
      sums: the loss sums so far.
    """

    ring: list
    inbox: Any
    back: Message
    stored: Message
    grads: tuple
    sums: Any


def _row(device: Device, name: str, tick: Any) -> jax.Array:
    """This device's entry of table ``name`` at ``tick``."""
    table = getattr(_ticks_of(device).tables(), name)
    return jnp.asarray(table)[device.stage, tick]


def _on_chunk(
    device: Device, index: Any, chunk: Any, fn: Callable[..., Any], *operands: Any
) -> Any:
    """``fn((own, key), *operands)`` on micro-batch ``index`` at ``chunk``
    (:func:`~jaxaccum._pipeline._chunk_params.on_chunk`: a ``lax.switch``
    whose branch reads its chunk's parameters at a static index, of
    ``device.own_stages``, :func:`_chunks`), with the key of its model stage
    (``d``, or ``2 S - 1 - d`` for the up chunk)."""
    last = 2 * device.schedule.num_stages - 1
    layer = jnp.where(chunk == 0, device.stage, last - device.stage)
    key = microbatch_key(device, index, layer)
    axes = axes_of(device)

    def run(own: Any, key: Any, *ops: Any) -> Any:
        return varying(fn((own, key), *ops), axes)

    return on_chunk(device.own_stages, chunk, run, key, *operands)


def _write(slots: Any, value: Any, slot: Any) -> Any:
    """``slots`` with ``value`` in ``slot`` where ``slot >= 0`` (a scatter
    that drops the write elsewhere: the slot's old value is not read)."""

    def put(s: jax.Array, v: jax.Array) -> jax.Array:
        index = jnp.where(slot >= 0, slot, s.shape[0])
        return s.at[index].set(v, mode="drop")

    return jax.tree.map(put, slots, value)


def _read(slots: Any, slot: Any) -> Any:
    return jax.tree.map(
        lambda s: lax.dynamic_index_in_dim(s, slot, 0, keepdims=False), slots
    )


def _added_at(total: Any, grad: Any, factor: Any, chunk: Any) -> Any:
    """``total[chunk] += grad[0] * factor`` leaf by leaf, in ``total``'s
    dtypes."""

    def add(t: jax.Array, g: jax.Array) -> jax.Array:
        old = lax.dynamic_slice_in_dim(t, chunk, 1, 0)
        new = old + (g.astype(t.dtype) * factor).astype(t.dtype)
        return lax.dynamic_update_slice_in_dim(t, new, chunk, 0)

    return jax.tree.map(add, total, grad)


def _forward_slot(window: Window, ring: list, inbox: Any, tick: Tick, t: Any):
    """The tick's F: the chunk's stage on the inbox's activation (embedded
    where the micro-batch enters), its residuals to the ring's slot.
    Returns the output and the ring."""
    device = window.device
    valid, micro, chunk = tick.valid, tick.microbatch, tick.repeat

    def embed():
        batch = device.batch.microbatch(micro)
        key = microbatch_key(device, micro, 2 * device.schedule.num_stages)
        return varying(device.calls.embed(device.embed, batch, key), axes_of(device))

    entering = device_cond(device, tick.enters, embed, lambda: device.fill)
    x = select(tick.enters, entering, _read(inbox, _row(device, "x_slot", t)))
    x = select(valid, x, device.fill)

    def stage(given, x):
        y, saved, pullback = forward(stage_call(device), given, x)
        window.pullback[:] = [pullback]
        return y, saved

    def run(x):
        return _on_chunk(device, micro, chunk, stage, x)

    def idle(x):
        return device.fill, [jnp.zeros(r.shape[1:], r.dtype) for r in ring]

    if window.skip:
        y, saved = device_cond(device, valid, run, idle, x)
    else:
        y, saved = run(x)
    slot = jnp.where(valid, _row(device, "ring", t), -1)
    return y, _write(ring, saved, slot)


def _input_slot(window: Window, halves: Halves, carry: Carry, saved: list, t: Any):
    """The tick's B: the chunk's input cotangent (B's half) from its ring
    slot and the cotangent waiting in its inbox slot, its boundary stored;
    after device 0's down chunk the embedding's backward. Returns the
    embedding gradient, the message handed on, the stored boundaries and
    the embedding's squared norm."""
    device = window.device
    valid = _row(device, "op", t) == 1
    micro, chunk = _row(device, "micro", t), _row(device, "chunk", t)
    message = _read(carry.back, _row(device, "g_slot", t))
    back, stored = input_half(
        window,
        halves,
        functools.partial(_on_chunk, device, micro, chunk),
        valid,
        (saved, message),
        (carry.stored, _row(device, "stored", t)),
    )
    first = valid & (chunk == 0)
    embed_grad, embed_sq = embed_backward(window, carry.grads[0], back, micro, first)
    return embed_grad, back, stored, embed_sq


def _weight_slot(
    window: Window, halves: Halves, stage_grad: Any, saved: list, stored: Message, t
):
    """The tick's W: the chunk's parameters' gradient (W's half, from its
    residuals and its stored boundary), accumulated at the chunk at its
    share. Returns the stage gradients and the squared norm."""
    device = window.device
    valid = _row(device, "op", t) == 2
    micro, chunk = _row(device, "micro", t), _row(device, "chunk", t)
    boundary = _read(stored, _row(device, "stored", t))
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))

    def part(given, saved, cotangent):
        args = [*jax.tree.leaves((given, saved)), *[None] * halves.handed]
        return weight_part(halves.split, args, cotangent)

    def run(stage_grad, saved, boundary):
        weights = _on_chunk(device, micro, chunk, part, saved, boundary.cotangent)
        own_grad = jax.tree.unflatten(halves.own, weights[: halves.own.num_leaves])
        accum = device.options.accum_dtype
        grad = jax.tree.map(
            lambda g: g.astype(accum_dtype_for(g.dtype, accum)), own_grad
        )
        share = boundary.share
        sq = own_sq(window, grad, share) if window.probed else zero
        grad = jax.tree.map(lambda g: jnp.where(valid, g, 0), grad)
        return _added_at(stage_grad, grad, unshare(window, share), chunk), sq

    def idle(stage_grad, *_):
        return stage_grad, zero

    if window.skip:
        return device_cond(device, valid, run, idle, stage_grad, saved, boundary)
    return run(stage_grad, saved, boundary)


def _handed(device: Device, y: Any, dx: Message, loss: Message) -> tuple:
    """The next tick's arrivals: this tick's F output and B cotangent sent
    both ways by four permutes; at the tip (device ``S - 1``) its own F
    output and B cotangent, on device 0 its loss's cotangent, kept."""
    stages, stage = device.schedule.num_stages, device.stage
    axis = device.options.layout.stage_axis
    down = [(d, d + 1) for d in range(stages - 1)]
    up = [(d + 1, d) for d in range(stages - 1)]
    tip, first = stage == stages - 1, stage == 0
    x_down = lax.ppermute(y, axis, down)
    x_up = select(tip, y, lax.ppermute(y, axis, up))
    g_down = select(tip, dx, lax.ppermute(dx, axis, up))
    g_up = select(first, loss, lax.ppermute(dx, axis, down))
    return x_down, x_up, g_down, g_up


def _arrived(device: Device, carry: Carry, handed: tuple, t: Any) -> tuple:
    """The inboxes with ``handed`` (:func:`_handed`, sent at tick ``t``) in
    the slots the tables give its arrival at ``t + 1`` (none past the
    loop's ticks), so no arrival is carried over the tick."""
    x_down, x_up, g_down, g_up = handed
    nxt = jnp.minimum(t + 1, _ticks_of(device).loop_ticks - 1)
    last = t + 1 >= _ticks_of(device).loop_ticks

    def slot(name: str) -> Any:
        return jnp.where(last, -1, _row(device, name, nxt))

    inbox = _write(carry.inbox, x_down, slot("x_down"))
    inbox = _write(inbox, x_up, slot("x_up"))
    back = _write(carry.back, g_down, slot("g_down"))
    return inbox, _write(back, g_up, slot("g_up"))


def _saved(device: Device, ring: list, t: Any) -> list:
    """The residuals in the tick's ring slot, read once for its B and W
    (one of them runs; two reads would be two copies)."""
    return read_ring(ring, _row(device, "ring", t))


def _one_tick(window: Window, halves: Halves, carry: Carry, t: Any):
    """One loop tick of one device: its F, B or W (each a ``lax.cond`` the
    tables switch on) on what waits in its inboxes, the loss where device
    0's up chunk ran its F; what it made handed on, into the inboxes."""
    device = window.device
    tick = _ticks_of(device).at(t, device.stage)
    y, ring = _forward_slot(window, carry.ring, carry.inbox, tick, t)
    head_grad, sums, out, loss, head_sq = loss_slot(window, carry, y, tick)
    carry = carry._replace(grads=(*carry.grads[:2], head_grad))
    saved = _saved(device, ring, t)
    embed_grad, dx, stored, embed_sq = _input_slot(window, halves, carry, saved, t)
    stage_grad, stage_sq = _weight_slot(
        window, halves, carry.grads[1], saved, stored, t
    )
    inbox, back = _arrived(device, carry, _handed(device, y, dx, loss), t)
    grads = (embed_grad, stage_grad, head_grad)
    per_tick = (out.loss, out.weight, embed_sq, stage_sq, head_sq)
    return Carry(ring, inbox, back, stored, grads, sums), per_tick


def _appended_tick(window: Window, halves: Halves, carry: Carry, t: Any):
    """One tick after the last F and B: its W only."""
    embed, stage_grad, head = carry.grads
    saved = _saved(window.device, carry.ring, t)
    stage_grad, stage_sq = _weight_slot(
        window, halves, stage_grad, saved, carry.stored, t
    )
    return carry._replace(grads=(embed, stage_grad, head)), stage_sq


def _initial(window: Window, static: Static, boundary: list) -> Carry:
    """The carry before the first tick: empty ring, inboxes and stored
    boundaries (the tables' sizes), zero sums."""
    device = window.device
    tables = _ticks_of(device).tables()
    one = initial_carry(window, static.shapes, _first(device))

    def slots(count: int, like: Any) -> Any:
        return jax.tree.map(lambda x: jnp.zeros((count, *x.shape), x.dtype), like)

    stored = Message(
        [jnp.zeros((tables.stored_size, *x.shape), x.dtype) for x in boundary],
        jnp.zeros((tables.stored_size,), window.share_dtype),
    )
    inbox = slots(tables.inbox_size, one.incoming)
    back = slots(tables.back_size, one.back)
    stored, inbox, back = varying((stored, inbox, back), axes_of(device))
    return Carry(one.ring, inbox, back, stored, one.grads, one.sums)


def _first(device: Device) -> tuple:
    """A down chunk's ``(stage parameters, key)``: what the ring's and the
    stored boundaries' slots are shaped by."""
    return read(device.own_stages, 0), microbatch_key(device, 0, device.stage)


def _chunks(device: Device) -> Device:
    """``device`` with its two chunks (:class:`Chunks`): the down chunk's
    stage ``d`` and the up chunk's, ``2 S - 1 - d``. In device order the
    rows of its stack as given; in model order split before the loop, the
    second row from device ``S - 1 - d`` (one permute, as :func:`_mirrored`
    lays them out)."""
    layout, num_stages = device.options.layout, device.schedule.num_stages
    own = device.own_stages
    if layout.stage_order == "device":
        return device._replace(own_stages=held(own, 2))
    down = jax.tree.map(lambda p: p[:1], own)
    up = jax.tree.map(lambda p: _second_row(p, layout.stage_axis, num_stages), own)
    return device._replace(own_stages=split((down, up)))


def _mirrored(stages: Any, axis: str, num_stages: int) -> Any:
    """Each stacked ``(2, ...)`` leaf with its second row from device ``S -
    1 - d`` (one permute): the interleaved layout's stages ``d`` and ``S +
    d`` become the V's ``d`` and ``2 S - 1 - d``, and back (its own
    inverse)."""
    return jax.tree.map(
        lambda p: jnp.concatenate([p[:1], _second_row(p, axis, num_stages)]), stages
    )


def _second_row(leaf: jax.Array, axis: str, num_stages: int) -> jax.Array:
    """A stacked ``(2, ...)`` leaf's second row, ``(1, ...)``, from device
    ``S - 1 - d`` (one permute)."""
    pairs = [(d, num_stages - 1 - d) for d in range(num_stages)]
    return lax.ppermute(leaf[1:], axis, pairs)


def run_window(
    static: Static, skip: bool, params: tuple, batch: Batch, key: Any, loss_scale: Any
):
    """One device's V window under ``shard_map``; returns what the 1F1B
    window's ``run_window`` does (the stage probes per tick, the W-only
    ticks' included)."""
    options, schedule = static.options, cast(VTicks, static.schedule)
    window = make_window(static, skip, params, batch, key, loss_scale)
    window = window._replace(device=_chunks(window.device))
    halves, boundary = split_stage(window.device, _first(window.device))
    carry, per_tick = loops(
        functools.partial(_one_tick, window, halves),
        functools.partial(_appended_tick, window, halves),
        _initial(window, static, boundary),
        schedule,
        options.unroll,
    )
    sums, per_micro, grads, probes = window_results(
        carry, per_tick, schedule, static.fsdp_dims, options
    )
    stages = grads[1]
    if options.layout.stage_order == "model":
        stages = _mirrored(stages, options.layout.stage_axis, schedule.num_stages)
    return sums, per_micro, (grads[0], stages, grads[2]), probes
