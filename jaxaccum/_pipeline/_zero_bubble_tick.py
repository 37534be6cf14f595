"""One device's zero-bubble window (``_zero_bubble``), tick by tick on
its grid: what arrived written to the inboxes; the F slot (1F1B's forward
slot, ``_1f1b_tick``, on the inbox's activation; the loss on the last
stage, its cotangent put in the inbox); the B slot (B's half of the
stage's backward, ``_zero_bubble_split``: the stage input's cotangent from
the residual ring and the inbox, handed back; the boundary W reads
stored); the W slot (W's half: the stage parameters' gradient from both
rings); the neighbour permutes. Then the W slots of the ticks after the
last F and B."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._pipeline._1f1b import (
    initial_carry,
    make_window,
    ring_slots,
    window_results,
)
from jaxaccum._pipeline._1f1b_tick import (
    Message,
    RingTicks,
    Window,
    added,
    axes_of,
    backward,
    device_cond,
    embed_backward,
    floats,
    forward,
    forward_slot,
    full_cotangent,
    loss_slot,
    own_sq,
    read_ring,
    stage_call,
    stage_given,
    unshare,
)
from jaxaccum._pipeline._calls import LossOut
from jaxaccum._pipeline._device import Device, Shapes, Static, select, varying
from jaxaccum._pipeline._zero_bubble_split import (
    SplitBackward,
    input_part,
    split_backward,
    weight_part,
)
from jaxaccum._types import Batch
from jaxaccum._window._accum_dtypes import accum_dtype_for


class GridTicks(RingTicks, Protocol):
    """What a zero-bubble window reads of its schedule (a
    ``_zero_bubble.ZeroBubble``: the protocol keeps this module below it):
    its ``Grid`` of F, B and W ticks, the stored boundaries' slots, the
    loop's length."""

    @property
    def stored_size(self) -> int: ...

    @property
    def loop_ticks(self) -> int: ...

    @property
    def num_ticks(self) -> int: ...

    def grid(self) -> Any: ...

    def weight_table(self) -> np.ndarray: ...


def _ticks_of(device: Device) -> GridTicks:
    return cast(GridTicks, device.schedule)


class Carry(NamedTuple):
    """A device's scan carry: 1F1B's, the inboxes, and ``stored``, each B
    slot's boundary and share as a :class:`Message` (``(J, ...)`` slots per
    boundary value, ``(J,)`` shares), read by the micro-batch's W slot.
    Micro-batch ``m``'s entry of a ring or inbox is in slot ``m`` modulo
    its size (the grid's).

    Attributes:
      incoming: the activation the previous stage's device handed over.
      back: the :class:`Message` the next stage's device handed back.
      ring: per saved residual, its ``(K, ...)`` slots.
      inbox: the activations waiting for their F slot (None where the
        grid is ``immediate``).
      inbox_back: the :class:`Message` s waiting for their B slot (None
        there too).
      stored: the stored boundaries and shares.
      grads: ``(embed, stages, head)`` gradients, in the accumulation dtype.
      sums: the :class:`LossOut` summed over the micro-batches so far.
    """

    incoming: Any
    back: Message
    ring: list
    inbox: Any
    inbox_back: Message | None
    stored: Message
    grads: tuple
    sums: LossOut


class Halves(NamedTuple):
    """The stage's backward split (:func:`split_backward`), traced once.

    Attributes:
      split: B's and W's equations and the boundary between them.
      args: the tree of the backward's ``(given, saved, cotangent)``.
      own: the tree of the stage parameters' cotangent.
      handed: the cotangent's leaves (the last of the flat arguments).
    """

    split: SplitBackward
    args: Any
    own: Any
    handed: int


def split_stage(device: Device, given: Any = None) -> tuple[Halves, list]:
    """The stage's backward split into B and W (traced on the fill and
    ``given``, by default ``stage_given(device, 0)``; the values are unused,
    dropped by XLA), and the boundary's values as examples of what a stored
    slot holds."""
    given = stage_given(device, 0) if given is None else given
    y, saved, pullback = forward(stage_call(device), given, device.fill)
    cotangent = full_cotangent(device.fill, floats(jax.tree.map(jnp.zeros_like, y)))
    leaves, tree = jax.tree.flatten((given, saved, cotangent))
    (own, _), dx = backward(pullback, given, saved, cotangent)

    def flat(*leaves: Any) -> list:
        return jax.tree.leaves(backward(pullback, *jax.tree.unflatten(tree, leaves)))

    handed = len(jax.tree.leaves(cotangent))
    split = split_backward(flat, leaves, len(jax.tree.leaves(dx)), handed)
    _, boundary = input_part(split, leaves)
    return Halves(split, tree, jax.tree.structure(own), handed), boundary


def _input_slot(
    window: Window, halves: Halves, carry: Carry, ring: list, message: Message, t: Any
):
    """The tick's B slot: micro-batch ``t - 2 (S - 1) + stage``'s input
    cotangent from its ring slot and the cotangent it was handed (B's half
    of the backward), handed back; the boundary W reads stored with the
    share; on the first stage the embedding's backward. Returns the
    embedding gradient, the message back, the stored ring and the
    embedding's squared norm."""
    device = window.device
    schedule = _ticks_of(device)
    valid, index = schedule.backward_at(t, device.stage)
    saved = read_ring(ring, index % schedule.ring_size)
    back, stored = input_half(
        window,
        halves,
        lambda fn, *operands: fn(stage_given(device, index), *operands),
        valid,
        (saved, message),
        (carry.stored, index % schedule.stored_size),
    )
    embed_grad, embed_sq = embed_backward(window, carry.grads[0], back, index, valid)
    return embed_grad, back, stored, embed_sq


def input_half(
    window: Window,
    halves: Halves,
    given: Callable[..., Any],
    valid: Any,
    read: tuple[list, Message],
    stored_at: tuple[Message, Any],
) -> tuple[Message, Message]:
    """B's half of a stage's backward where ``valid``: from the stage's
    given (its parameters and key; ``given(fn, *operands)`` returns ``fn(
    given, *operands)``, so a V's switch reads its chunk's whole), the
    residuals and the message ``read`` holds, the input's cotangent handed
    on (zero share where not valid) and the boundary stored, with the share,
    in slot ``slot`` of ``stored`` (``stored_at``). Returns the message and
    the stored slots."""
    device = window.device
    saved, message = read
    stored, slot = stored_at
    old = Message(
        read_ring(stored.cotangent, slot),
        lax.dynamic_index_in_dim(stored.share, slot, 0, keepdims=False),
    )

    def run(saved, message, old):
        cotangent = full_cotangent(device.fill, message.cotangent)

        def part(own, saved, cotangent):
            return input_part(halves.split, jax.tree.leaves((own, saved, cotangent)))

        dx, boundary = given(part, saved, cotangent)
        dx = [jnp.where(valid, g, 0) for g in floats(dx)]
        share = jnp.where(valid, message.share, 0)
        return Message(dx, share), Message(boundary, message.share)

    def idle(saved, message, old):
        return Message(message.cotangent, jnp.zeros_like(message.share)), old

    if window.skip:
        back, kept = device_cond(device, valid, run, idle, saved, message, old)
    else:
        back, kept = run(saved, message, old)
        kept = select(valid, kept, old)
    stored = jax.tree.map(
        lambda r, s: lax.dynamic_update_index_in_dim(r, s, slot, 0), stored, kept
    )
    return back, stored


def _weight_slot(
    window: Window, halves: Halves, stage_grad: Any, ring: list, stored: Message, t
):
    """The tick's W slot: the stage parameters' gradient of the micro-batch
    the W table gives this device at tick ``t`` (W's half of the backward,
    from its residuals, slot ``m % K``, and its stored boundary), accumulated
    at its share. Returns the stage gradient and its squared norm."""
    device = window.device
    schedule = _ticks_of(device)
    micro = jnp.asarray(schedule.weight_table())[device.stage, t]
    valid, index = micro >= 0, jnp.maximum(micro, 0)
    saved = read_ring(ring, index % schedule.ring_size)
    slot = index % schedule.stored_size
    boundary = read_ring(stored.cotangent, slot)
    share = lax.dynamic_index_in_dim(stored.share, slot, 0, keepdims=False)
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))

    def run(stage_grad, saved, boundary, share):
        given = stage_given(device, index)
        args = [*jax.tree.leaves((given, saved)), *[None] * halves.handed]
        weights = weight_part(halves.split, args, boundary)
        own_grad = jax.tree.unflatten(halves.own, weights[: halves.own.num_leaves])
        accum = device.options.accum_dtype
        grad = jax.tree.map(
            lambda g: g.astype(accum_dtype_for(g.dtype, accum)), own_grad
        )
        sq = own_sq(window, grad, share) if window.probed else zero
        grad = jax.tree.map(lambda g: jnp.where(valid, g, 0), grad)
        return added(stage_grad, grad, unshare(window, share)), sq

    def idle(stage_grad, *_):
        return stage_grad, zero

    operands = (stage_grad, saved, boundary, share)
    if window.skip:
        return device_cond(device, valid, run, idle, *operands)
    return run(*operands)


def _slots(count: int, like: Any) -> Any:
    """``count`` zero slots of each leaf of ``like``."""
    return jax.tree.map(lambda x: jnp.zeros((count, *x.shape), x.dtype), like)


def _put(slots: Any, value: Any, micro: Any, valid: Any) -> Any:
    """``slots`` with ``value`` in micro-batch ``micro``'s slot where
    ``valid`` (each leaf's slot left as it was elsewhere)."""

    def put(s: jax.Array, v: jax.Array) -> jax.Array:
        slot = micro % s.shape[0]
        old = lax.dynamic_index_in_dim(s, slot, 0, keepdims=False)
        return lax.dynamic_update_index_in_dim(s, select(valid, v, old), slot, 0)

    return jax.tree.map(put, slots, value)


def _take(slots: Any, micro: Any) -> Any:
    """Micro-batch ``micro``'s slot of each leaf of ``slots``."""
    return jax.tree.map(
        lambda s: lax.dynamic_index_in_dim(s, micro % s.shape[0], 0, keepdims=False),
        slots,
    )


def _arrived(device: Device, carry: Carry, tick_index: Any) -> tuple[Any, Any]:
    """The inboxes with what the neighbours handed over last tick put in
    (the grid says which micro-batch's, if any); the handed values
    themselves where every arrival is used in its tick."""
    grid, stage = _ticks_of(device).grid(), device.stage
    if grid.immediate:
        return carry.incoming, carry.back
    x_micro = jnp.asarray(grid.x_arrival)[stage, tick_index]
    back_micro = jnp.asarray(grid.back_arrival)[stage, tick_index]
    inbox = _put(carry.inbox, carry.incoming, x_micro, x_micro >= 0)
    inbox_back = _put(carry.inbox_back, carry.back, back_micro, back_micro >= 0)
    return inbox, inbox_back


def _one_tick(window: Window, halves: Halves, carry: Carry, tick_index: Any):
    """One loop tick of one device: the arrivals put in the inboxes, its F
    slot on the activation waiting for it (the loss on the last stage, its
    cotangent put in the inbox), its B slot on the cotangent waiting for
    it, its W slot; the activation handed on, the cotangent handed back."""
    device = window.device
    immediate = _ticks_of(device).grid().immediate
    inbox, inbox_back = _arrived(device, carry, tick_index)
    f_micro = device.schedule.at(tick_index, device.stage).microbatch
    x = inbox if immediate else _take(inbox, f_micro)
    y, ring, tick = forward_slot(window, carry._replace(incoming=x), tick_index)
    head_grad, sums, out, message, head_sq = loss_slot(window, carry, y, tick)
    _, b_micro = _ticks_of(device).backward_at(tick_index, device.stage)
    if immediate:  # the last device's B is its F's micro-batch, in its tick
        handed = select(tick.exits, message, inbox_back)
        inbox, inbox_back = None, None
    else:
        inbox_back = _put(inbox_back, message, tick.microbatch, tick.exits)
        handed = _take(inbox_back, b_micro)
    carry = carry._replace(grads=(*carry.grads[:2], head_grad))
    embed_grad, back, stored, embed_sq = _input_slot(
        window, halves, carry, ring, handed, tick_index
    )
    stage_grad, stage_sq = _weight_slot(
        window, halves, carry.grads[1], ring, stored, tick_index
    )
    axis, schedule = device.options.layout.stage_axis, device.schedule
    incoming = lax.ppermute(y, axis, schedule.forward_ring())
    back = lax.ppermute(back, axis, schedule.backward_ring())
    grads = (embed_grad, stage_grad, head_grad)
    per_tick = (out.loss, out.weight, embed_sq, stage_sq, head_sq)
    carry = Carry(incoming, back, ring, inbox, inbox_back, stored, grads, sums)
    return carry, per_tick


def _appended_tick(window: Window, halves: Halves, carry: Carry, tick_index: Any):
    """One tick after the last F and B: the W slot only."""
    embed, stage_grad, head = carry.grads
    stage_grad, stage_sq = _weight_slot(
        window, halves, stage_grad, carry.ring, carry.stored, tick_index
    )
    return carry._replace(grads=(embed, stage_grad, head)), stage_sq


def _initial(window: Window, shapes: Shapes, boundary: list) -> Carry:
    """1F1B's carry before the first tick, empty inboxes and an empty
    stored ring (slots like ``boundary``)."""
    one = initial_carry(window, shapes)
    count = _ticks_of(window.device).stored_size
    stored = Message(
        [ring_slots(x, count) for x in boundary],
        jnp.zeros((count,), window.share_dtype),
    )
    grid = _ticks_of(window.device).grid()
    inbox, inbox_back = None, None  # immediate: what arrives is used at once
    if not grid.immediate:
        inbox = _slots(grid.inbox_size, one.incoming)
        inbox_back = _slots(grid.back_size, one.back)
    stored, inbox, inbox_back = varying(
        (stored, inbox, inbox_back), axes_of(window.device)
    )
    return Carry(
        one.incoming, one.back, one.ring, inbox, inbox_back, stored, one.grads, one.sums
    )


def run_window(
    static: Static, skip: bool, params: tuple, batch: Batch, key: Any, loss_scale: Any
):
    """One device's zero-bubble window under ``shard_map``; returns what the
    1F1B window's ``run_window`` does (the stage probes per tick, the
    W-only ticks' included)."""
    options, schedule = static.options, cast(GridTicks, static.schedule)
    window = make_window(static, skip, params, batch, key, loss_scale)
    device = window.device
    halves, boundary = split_stage(device)
    carry, per_tick = loops(
        functools.partial(_one_tick, window, halves),
        functools.partial(_appended_tick, window, halves),
        _initial(window, static.shapes, boundary),
        schedule,
        options.unroll,
    )
    return window_results(carry, per_tick, schedule, static.fsdp_dims, options)


def loops(
    one_tick: Callable[[Any, Any], Any],
    appended_tick: Callable[[Any, Any], Any],
    carry: Any,
    schedule: Any,
    unroll: Any,
) -> tuple[Any, tuple]:
    """A split-backward window's two loops: ``one_tick`` over the ticks up
    to the last F and B (``schedule.loop_ticks``), then ``appended_tick``
    (W slots only, no permutes) to ``schedule.num_ticks``. Returns the carry
    and the per-tick ``(loss, weight, embed_sq, stage_sq, head_sq)``, the
    stage's squared norms of every tick."""
    carry, (loss, weight, embed_sq, stage_sq, head_sq) = lax.scan(
        one_tick, carry, jnp.arange(schedule.loop_ticks), unroll=unroll
    )
    if schedule.num_ticks > schedule.loop_ticks:
        carry, appended_sq = lax.scan(
            appended_tick,
            carry,
            jnp.arange(schedule.loop_ticks, schedule.num_ticks),
            unroll=unroll,
        )
        stage_sq = jnp.concatenate([stage_sq, appended_sq])
    return carry, (loss, weight, embed_sq, stage_sq, head_sq)
