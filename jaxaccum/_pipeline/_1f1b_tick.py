"""One tick of a device's 1F1B window (``_1f1b``): its forward slot (the
stage, its residuals written to the ring), the loss on the last stage
(the backward seeded there), its backward slot (the stage's ``jax.vjp``
rebuilt from a ring slot), and the neighbour permutes."""

from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxaccum._pipeline._calls import LossOut
from jaxaccum._pipeline._device import Device, microbatch_key, select, varying
from jaxaccum._precision._loss_scale import scale_loss
from jaxaccum._window._accum_dtypes import accum_dtype_for
from jaxaccum._window._micro_result import microbatch_share
from jaxaccum._window._noise_scale import unscaled_squared_norm


class RingTicks(Protocol):
    """What a 1F1B window reads of its schedule beyond a ``Schedule``'s (a
    ``_1f1b.OneFOneB`` or a subclass: the protocol keeps this module below
    them): the ring, the backward slots, the loss and embedding ticks."""

    @property
    def num_microbatches(self) -> int: ...

    @property
    def ring_size(self) -> int: ...

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]: ...

    def loss_ticks(self) -> np.ndarray: ...

    def embed_ticks(self) -> np.ndarray: ...


def ticks_of(device: Device) -> RingTicks:
    """The device's schedule, a ``OneFOneB``."""
    return cast(RingTicks, device.schedule)


class Pullback(NamedTuple):
    """How to rebuild a stage's pullback from its ring slot: the pullback's
    tree and, per leaf, the index of the ``(parameters, key)`` leaf it is
    (rebuilt from the backward's own), or -1 (saved in the ring)."""

    treedef: Any
    where: tuple[int, ...]


def forward(stage: Any, given: Any, x: Any) -> tuple[Any, list, Pullback]:
    """``stage(given, x)`` and its backward's residuals less ``given``'s
    leaves (the parameters and key: a ring slot would copy the stage's
    parameters), with how to rebuild the pullback."""
    y, pullback = jax.vjp(stage, given, x)
    leaves, treedef = jax.tree.flatten(pullback)
    known = jax.tree.leaves(given)
    where = tuple(
        next((i for i, k in enumerate(known) if leaf is k), -1) for leaf in leaves
    )
    saved = [leaf for leaf, i in zip(leaves, where, strict=True) if i < 0]
    return y, saved, Pullback(treedef, where)


def backward(pullback: Pullback, given: Any, saved: list, cotangent: Any):
    """The cotangents of ``(given, x)`` from a ring slot's residuals."""
    known, rest = jax.tree.leaves(given), iter(saved)
    leaves = [known[i] if i >= 0 else next(rest) for i in pullback.where]
    return jax.tree.unflatten(pullback.treedef, leaves)(cotangent)


class Message(NamedTuple):
    """What a stage's backward hands to the stage before: the cotangent of
    the activation's float leaves, and the micro-batch's share."""

    cotangent: list
    share: jax.Array


class Carry(NamedTuple):
    """A device's scan carry.

    Attributes:
      incoming: the activation the previous stage's device handed over.
      back: the :class:`Message` the next stage's device handed back.
      ring: per saved residual, its ``(K, ...)`` slots.
      grads: ``(embed, stages, head)`` gradients, in the accumulation dtype.
      sums: the :class:`LossOut` summed over the micro-batches so far.
    """

    incoming: Any
    back: Message
    ring: list
    grads: tuple
    sums: LossOut


class Window(NamedTuple):
    """What a device's ticks read besides :class:`Device`.

    Attributes:
      device: the device's parameters, batch, keys and fill.
      scale: the loss scale the seeds are multiplied by, or None.
      num_means: ``M D``, the window's micro-batch pieces.
      skip: whether a bubble's stage slots are skipped (``lax.cond``) or
        computed on the fill and selected away.
      probed: whether the ticks take squared gradient norms.
      pullback: the ring slots' :class:`Pullback` (filled when traced).
      share_dtype: the dtype of the shares (the loss sum's, at least
        float32).
    """

    device: Device
    scale: jax.Array | None
    num_means: int
    skip: bool
    probed: bool
    pullback: list
    share_dtype: Any


def floats(tree: Any) -> list:
    """The inexact leaves of ``tree`` (the ones with cotangents)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def full_cotangent(like: Any, floats: list) -> Any:
    """A cotangent for ``like``: ``floats`` in its inexact leaves, float0
    zeros in its integer and bool leaves."""
    rest = iter(floats)
    leaves = [
        next(rest)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else jnp.zeros(x.shape, jax.dtypes.float0)
        for x in jax.tree.leaves(like)
    ]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def added(total: Any, grad: Any, factor: Any) -> Any:
    """``total + grad * factor`` leaf by leaf, in ``total``'s dtypes."""
    return jax.tree.map(
        lambda t, g: t + (g.astype(t.dtype) * factor).astype(t.dtype), total, grad
    )


def own_sq(window: Window, grad: Any, share: jax.Array) -> jax.Array:
    """The squared norm of the loss's own gradient, from ``grad`` (at the
    micro-batch's share and the loss scale, divided out leaf by leaf before
    squaring; the share after, twice)."""
    divisor = jnp.float32(1) if window.scale is None else window.scale
    positive = share > 0
    safe = jnp.where(positive, share, 1)
    sq = jnp.where(positive, unscaled_squared_norm(grad, divisor) / safe / safe, 0)
    return sq.astype(jnp.float32)


def unshare(window: Window, share: jax.Array) -> jax.Array:
    """What a micro-batch's gradient at ``share`` is multiplied by as it
    accumulates: 1, or with ``"weighted"`` ``1 / share`` (the window's
    gradient of the loss sum, divided by the total weight after the loop,
    as the core's window does)."""
    if window.device.options.reduction != "weighted":
        return jnp.float32(1)
    positive = share > 0
    return jnp.where(positive, 1 / jnp.where(positive, share, 1), 0)


def stage_given(device: Device, index: Any) -> tuple:
    """``(own stages, key)`` of micro-batch ``index`` at this device's stage."""
    return device.own_stages, microbatch_key(device, index, device.stage)


def stage_call(device: Device):
    """The stage as ``stage((own, key), x)``, for :func:`forward`."""
    return lambda given, x: device.calls.bare_stage(given[0], 0, x, given[1])


def device_cond(device: Device, pred: Any, on_true, on_false, *operands: Any) -> Any:
    """``lax.cond`` on this device's ``pred``, both branches' results typed
    varying over the manual axes (a branch's constant and the other's
    per-device value are one type)."""
    axes = axes_of(device)
    return lax.cond(
        pred,
        lambda *a: varying(on_true(*a), axes),
        lambda *a: varying(on_false(*a), axes),
        *operands,
    )


def read_ring(ring: list, slot: Any) -> list:
    return [lax.dynamic_index_in_dim(r, slot, 0, keepdims=False) for r in ring]


def forward_slot(window: Window, carry: Any, tick_index: Any):
    """The tick's forward slot: the stage on the micro-batch of ``tick -
    stage`` (embedded here on the first stage), its residuals written to the
    ring (``carry``: a :class:`Carry`, or a schedule's with its fields).
    Returns the stage's output, the ring, and the micro-batch."""
    device, schedule = window.device, window.device.schedule
    tick = schedule.at(tick_index, device.stage)
    layers = schedule.num_stages

    def embed():
        micro = device.batch.microbatch(tick.microbatch)
        key = microbatch_key(device, tick.microbatch, layers)
        return varying(device.calls.embed(device.embed, micro, key), axes_of(device))

    entering = device_cond(device, tick.enters, embed, lambda: device.fill)
    x = select(device.stage == 0, entering, carry.incoming)
    x = select(tick.valid, x, device.fill)
    slot = tick.microbatch % ticks_of(device).ring_size
    old = read_ring(carry.ring, slot)

    def run(given, x):
        y, saved, pullback = forward(stage_call(device), given, x)
        window.pullback[:] = [pullback]
        return y, saved

    given = stage_given(device, tick.microbatch)
    if window.skip:
        y, saved = device_cond(
            device, tick.valid, run, lambda *_: (device.fill, old), given, x
        )
    else:
        y, saved = run(given, x)
        saved = select(tick.valid, saved, old)
    ring = [
        lax.dynamic_update_index_in_dim(r, s, slot, 0)
        for r, s in zip(carry.ring, saved, strict=True)
    ]
    return y, ring, tick


def axes_of(device: Device) -> tuple[str, ...]:
    return device.options.layout.manual_axes


def loss_slot(window: Window, carry: Any, y: Any, tick: Any):
    """Where ``tick`` exits (the last stage's last repeat), micro-batch
    ``tick.microbatch``'s loss and the
    start of its backward: the loss's ``jax.vjp`` seeded with its share
    (times the loss scale). Returns the carry's head gradient and sums, the
    loss (zeros elsewhere), the cotangent message and the head's squared
    norm."""
    device = window.device
    schedule, options = device.schedule, device.options
    head_grad, sums = carry.grads[2], carry.sums
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))

    def take(head_grad, sums, y):
        micro = device.batch.microbatch(tick.microbatch)
        layers = schedule.num_stages * schedule.repeats
        key = microbatch_key(device, tick.microbatch, layers + 1)

        def loss(head, y):
            out = device.calls.loss(head, y, micro, key)
            return out.loss, out

        value, pullback, out = jax.vjp(loss, device.head, y, has_aux=True)
        share = microbatch_share(
            options, window.num_means, out.weight, window.share_dtype
        )
        seed = share if window.scale is None else scale_loss(share, window.scale)
        grad, dy = pullback(varying(seed.astype(value.dtype), axes_of(device)))
        sq = own_sq(window, grad, share) if window.probed else zero
        head_grad = added(head_grad, grad, unshare(window, share))
        sums = jax.tree.map(jnp.add, sums, out)
        return head_grad, sums, out, Message(floats(dy), share), sq

    def idle(head_grad, sums, y):
        none = jnp.zeros((), window.share_dtype)
        message = Message(floats(jax.tree.map(jnp.zeros_like, y)), none)
        return head_grad, sums, device.no_loss, message, zero

    return device_cond(device, tick.exits, take, idle, head_grad, sums, y)


def _backward_slot(window: Window, carry: Carry, ring: list, message, t: Any):
    """The tick's backward slot: micro-batch ``t - 2 (S - 1) + stage``'s
    stage backward from its ring slot, accumulated; on the first stage the
    embedding's. Returns the gradients, the message to the stage before,
    and the stage's and embedding's squared norms."""
    device = window.device
    schedule = ticks_of(device)
    valid, index = schedule.backward_at(t, device.stage)
    saved = read_ring(ring, index % schedule.ring_size)
    embed_grad, stage_grad, head_grad = carry.grads
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))
    like = device.fill

    def run(stage_grad, saved, message):
        given = stage_given(device, index)
        cotangent = full_cotangent(like, message.cotangent)
        (own_grad, _), dx = backward(window.pullback[0], given, saved, cotangent)
        grad = jax.tree.map(
            lambda g: g.astype(accum_dtype_for(g.dtype, device.options.accum_dtype)),
            own_grad,
        )
        sq = own_sq(window, grad, message.share) if window.probed else zero
        grad = jax.tree.map(lambda g: jnp.where(valid, g, 0), grad)
        stage_grad = added(stage_grad, grad, unshare(window, message.share))
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
    embed_grad, embed_sq = embed_backward(window, embed_grad, back, index, valid)
    return (embed_grad, stage_grad, head_grad), back, (embed_sq, stage_sq)


def embed_backward(window: Window, embed_grad: Any, back: Message, index, valid):
    """On the first stage, micro-batch ``index``'s embedding backward (its
    forward recomputed from the batch), accumulated."""
    device = window.device
    zero = varying(jnp.zeros((), jnp.float32), axes_of(device))

    def run(embed_grad, back):
        micro = device.batch.microbatch(index)
        schedule = device.schedule
        key = microbatch_key(device, index, schedule.num_stages * schedule.repeats)
        _, pullback = jax.vjp(lambda e: device.calls.embed(e, micro, key), device.embed)
        (grad,) = pullback(full_cotangent(device.fill, back.cotangent))
        sq = own_sq(window, grad, back.share) if window.probed else zero
        return added(embed_grad, grad, unshare(window, back.share)), sq

    first = valid & (device.stage == 0)
    return device_cond(device, first, run, lambda g, _: (g, zero), embed_grad, back)


def one_tick(window: Window, carry: Carry, tick_index: Any):
    """One tick of one device: its forward slot, the loss on the last stage,
    its backward slot; the activation handed on, the cotangent handed back."""
    device = window.device
    num = device.schedule.num_stages
    y, ring, tick = forward_slot(window, carry, tick_index)
    head_grad, sums, out, message, head_sq = loss_slot(window, carry, y, tick)
    last = device.stage == num - 1
    message = select(last, message, carry.back)
    carry = carry._replace(grads=(*carry.grads[:2], head_grad), sums=sums)
    grads, back, (embed_sq, stage_sq) = _backward_slot(
        window, carry, ring, message, tick_index
    )
    axis, schedule = device.options.layout.stage_axis, device.schedule
    incoming = lax.ppermute(y, axis, schedule.forward_ring())
    back = lax.ppermute(back, axis, schedule.backward_ring())
    per_tick = (out.loss, out.weight, embed_sq, stage_sq, head_sq)
    return Carry(incoming, back, ring, grads, sums), per_tick
