"""The GPipe schedule (circular when ``repeats > 1``): one device's window
under ``shard_map``, backward by autodiff through it. The first stage
embeds every micro-batch, the ticks run (activations handed on by
``ppermute``, recirculated for ``repeats > 1``), the last stage takes every
loss."""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

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
from jaxaccum._pipeline._run import Raw, Run
from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._pipeline._stats import make_probes, probed, unshared
from jaxaccum._precision._loss_scale import scale_loss
from jaxaccum._types import Batch, Fun, PyTree
from jaxaccum._window._micro_result import share_dtype
from jaxaccum._window._noise_scale import unscaled_squared_norm


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
    """GPipe: every forward pass in ``M R + S - 1`` ticks, device ``d``
    running iteration ``t - d`` of its ``M R`` at tick ``t``; the backward
    pass is autodiff's, through the loop (activation memory linear in
    ``M``). Circular when ``R > 1``: an activation leaving the last stage
    waits ``M - S`` ticks for the first stage's next repeat."""

    name: ClassVar[str] = "gpipe"

    @classmethod
    def check_window(cls, num_stages: int, num_microbatches: int, repeats: int) -> None:
        """Circular GPipe (``R > 1``) needs ``M >= S``."""
        num, stages = num_microbatches, num_stages
        if repeats > 1 and num < stages:
            raise ValueError(
                f"schedule='gpipe' with repeats={repeats} needs "
                f"num_microbatches >= the {stages} stages, got {num}: a "
                "micro-batch leaving the last "
                "stage re-enters the first stage M ticks after it first "
                "entered, which must not be before the first stage has passed "
                f"it on. Use M >= {stages}, schedule='1f1b' (interleaved 1F1B "
                "runs any M), or repeats=1 (any M; the bubble is then "
                f"{stages - 1} of every {num + stages - 1} ticks)."
            )

    @property
    def num_ticks(self) -> int:
        """``M R + S - 1``: each device runs ``M R`` iterations, the last
        starting ``S - 1`` ticks after the first."""
        return self.num_microbatches * self.repeats + self.num_stages - 1

    @property
    def recirculation_delay(self) -> int:
        """Ticks an activation leaving the last stage waits before the first
        stage runs its next repeat: ``M - S`` (a buffer of that many)."""
        return self.num_microbatches - self.num_stages if self.repeats > 1 else 0

    @property
    def first_exit(self) -> int:
        """The tick micro-batch 0 leaves the last stage of the last repeat."""
        return self.num_microbatches * (self.repeats - 1) + self.num_stages - 1

    def busy_table(self) -> np.ndarray:
        """Every tick a forward (the loop) and a backward (its transpose) on
        every device, a bubble's computed on the fill: 3 each."""
        return np.full((self.num_stages, self.num_ticks), 3.0)

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its forward iteration's."""
        ticks = np.arange(self.num_ticks)[None, :]
        return self._table(ticks - np.arange(self.num_stages)[:, None])

    def differentiate(
        self, run: Run, params: tuple, batch: Any, key: Any, loss_scale: Any
    ) -> Raw:
        """The pipelined loss sum and its gradient, autodiff through the
        ``shard_map``'d scan (the gradients reduced once, at its boundary).
        With ``loss_scale``, the loss sum is scaled before the backward pass
        and the gradients unscaled after it, in float32."""
        prepared, options = run.prepared, run.options
        params, batch, key = run.laid_out(params, batch, key)
        probes, probe_spec = make_probes(prepared, options, loss_scale)
        data = PartitionSpec(options.layout.data_axis)
        window = run.per_device(
            functools.partial(on_device, run.static()),
            in_specs=(run.params_specs(), probe_spec, data, PartitionSpec()),
            out_specs=(PartitionSpec(), (PartitionSpec(), run.device_spec())),
        )

        def differentiated(p, q):
            total, (sums, per_micro) = window(p, q, batch, key)
            share = run.share(sums.weight, share_dtype(total))
            total = total * share
            total = total if loss_scale is None else scale_loss(total, loss_scale)
            return total, (sums, per_micro, share)

        argnums = (0, 1) if probed(options) else 0
        (_, (sums, per_micro, share)), grads = jax.value_and_grad(
            differentiated, argnums, has_aux=True
        )(params, probes)
        grads, probe_grads = grads if probed(options) else (grads, None)
        raw = Raw(sums, per_micro, grads, unshared(probe_grads, share), share)
        return raw.unscaled(loss_scale)


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


def _ticks(device: Device) -> GPipe:
    """The device's schedule, a :class:`GPipe`."""
    assert isinstance(device.schedule, GPipe)
    return device.schedule


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
    delay = _ticks(device).recirculation_delay
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
    axis = device.options.layout.stage_axis
    incoming = lax.ppermute(y, axis, schedule.forward_ring())
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
    schedule = _ticks(device)
    num = schedule.num_microbatches
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
    first = schedule.first_exit
    return jax.tree.map(lambda y: y[first : first + num], leaving)


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
