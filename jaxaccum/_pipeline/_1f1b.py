"""The 1F1B schedule: one device's window under ``shard_map`` as one scan
in which every tick gives the device a forward slot and a backward slot.

Stage ``d`` runs micro-batch ``m``'s forward at tick ``m + d`` and its
backward at tick ``m + 2 (S - 1) - d``: the last stage takes the loss and
starts the backward in the tick of its forward, and each cotangent reaches
the stage before one tick later. A stage's backward is the ``jax.vjp`` of
the user's stage, rebuilt from what its forward saved in a ring of
``min(2 S - 1, M)`` slots (the stage's input with ``remat``, else the
residuals its checkpoint policy saves, never the parameters): the
activation memory does not grow with ``M``. Activations go forward and
cotangents back by ``ppermute`` to the neighbours only; the gradients
accumulate in the carry and are reduced once, after the loop."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._pipeline._1f1b_tick import (
    Carry,
    Message,
    RingTicks,
    Window,
    axes_of,
    floats,
    forward,
    one_tick,
    stage_call,
    stage_given,
    ticks_of,
)
from jaxaccum._pipeline._calls import LossOut
from jaxaccum._pipeline._device import (
    Probes,
    Shapes,
    Static,
    fill_like,
    make_device,
    varying,
)
from jaxaccum._pipeline._run import Raw, Run
from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._pipeline._stats import probed as probed_options
from jaxaccum._types import Batch, PyTree
from jaxaccum._window._micro_result import share_dtype


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B in one program: each tick a forward and a backward slot per
    device, ``M + 2 (S - 1)`` ticks; stage ``d`` runs micro-batch ``m``'s
    forward at tick ``m + d`` and its backward at tick ``m + 2 (S - 1) - d``
    (activation memory flat in ``M``). ``repeats=1`` only: with ``R > 1``
    ``schedule="1f1b"`` is ``_interleaved.Interleaved``."""

    name: ClassVar[str] = "1f1b"

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        if repeats > 1:
            raise ValueError(
                f"OneFOneB runs one stage a device, got repeats={repeats}: "
                "schedule='1f1b' with repeats > 1 is interleaved 1F1B, "
                "_interleaved.Interleaved (the schedule_type of the name)."
            )

    @property
    def lag(self) -> int:
        """``S - 1``: micro-batch ``m``'s loss is taken at tick ``m + S - 1``
        and its embedding's backward runs at tick ``m + 2 (S - 1)``."""
        return self.num_stages - 1

    @property
    def num_ticks(self) -> int:
        """``M + 2 (S - 1)``: a micro-batch's backward leaves the first stage
        ``2 (S - 1)`` ticks after its forward entered it."""
        return self.num_microbatches + 2 * self.lag

    @property
    def ring_size(self) -> int:
        """The stage inputs (or residuals) a device keeps, ``min(2 S - 1,
        M)``: stage ``d`` holds micro-batch ``m`` from its forward at tick
        ``m + d`` to its backward at tick ``m + 2 (S - 1) - d``."""
        return min(2 * self.num_stages - 1, self.num_microbatches)

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]:
        """Whether the device of ``stage`` runs a backward slot at ``tick``,
        and the micro-batch's (clipped in a bubble)."""
        iteration = tick - 2 * self.lag + stage
        valid = (iteration >= 0) & (iteration < self.num_microbatches)
        return valid, jnp.clip(iteration, 0, self.num_microbatches - 1)

    def busy_table(self) -> np.ndarray:
        """A forward slot (1) and a backward slot (2) where they carry a
        micro-batch (a bubble's slots are skipped)."""
        ticks = np.arange(self.num_ticks)[None, :]
        stage = np.arange(self.num_stages)[:, None]
        forward = (ticks - stage >= 0) & (ticks - stage < self.num_microbatches)
        iteration = ticks - 2 * self.lag + stage
        backward = (iteration >= 0) & (iteration < self.num_microbatches)
        return forward * 1.0 + backward * 2.0

    def loss_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the last device takes each micro-batch's loss,
        ``m + S - 1``."""
        return np.arange(self.num_microbatches) + self.lag

    def embed_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the first device runs each micro-batch's
        embedding backward, ``m + 2 (S - 1)``."""
        return np.arange(self.num_microbatches) + 2 * self.lag

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its backward slot's."""
        ticks = np.arange(self.num_ticks)[None, :]
        return self._table(ticks - 2 * self.lag + np.arange(self.num_stages)[:, None])

    def device_window(self) -> Callable[..., tuple]:
        """One device's window under ``shard_map``: :func:`run_window`."""
        return run_window

    def differentiate(
        self, run: Run, params: tuple, batch: Any, key: Any, loss_scale: Any
    ) -> Raw:
        """The window's sums and gradient from :func:`run_window` (each
        micro-batch's backward seeded with its share, times ``loss_scale``;
        the gradients unscaled after, in float32). A weighted window's
        gradient is of the loss sum until here, where it is divided by the
        total weight, as the core's window does."""
        options = run.options
        params, batch, key = run.laid_out(params, batch, key)
        window = run.per_device(
            functools.partial(self.device_window(), run.static(), run.skip_bubbles),
            in_specs=(
                run.params_specs(),
                PartitionSpec(options.layout.data_axis),
                PartitionSpec(),
                PartitionSpec(),
            ),
            out_specs=(
                PartitionSpec(),
                run.device_spec(),
                run.params_specs(),
                run.device_spec(),
            ),
        )
        sums, per_micro, grads, probes = window(params, batch, key, loss_scale)
        share = run.share(sums.weight, share_dtype(sums.loss))
        if options.reduction == "weighted":  # the loss sum's: divided by W
            grads = jax.tree.map(lambda g: (g * share).astype(g.dtype), grads)
        probes = probes if probed_options(options) else None
        return Raw(sums, per_micro, grads, probes, share).unscaled(loss_scale)


def reduced(grads: tuple, fsdp_dims: tuple, options: PipelineWindow) -> tuple:
    """The gradients summed over the devices once: the embedding's and the
    head's over every axis (they arise on one stage), the stages' over the
    data axis; FSDP leaves reduce-scattered over it on their dimension."""
    stage_axis, data_axis = options.layout.stage_axis, options.layout.data_axis

    def reduce(g: jax.Array, dim: int, over_stages: bool) -> jax.Array:
        if over_stages:
            g = lax.psum(g, stage_axis)
        if data_axis is None:
            return g
        if dim < 0:
            return lax.psum(g, data_axis)
        return lax.psum_scatter(g, data_axis, scatter_dimension=dim, tiled=True)

    (embed, stages, head), (embed_dims, stage_dims, head_dims) = grads, fsdp_dims
    return (
        jax.tree.map(lambda g, d: reduce(g, d, True), embed, embed_dims),
        jax.tree.map(lambda g, d: reduce(g, d, False)[:, None], stages, stage_dims),
        jax.tree.map(lambda g, d: reduce(g, d, True), head, head_dims),
    )


def ring_slots(like: jax.ShapeDtypeStruct, count: int) -> jax.Array:
    """``count`` zero slots for a residual shaped ``like`` (``jnp.zeros``
    takes a PRNG key dtype too: a stage may save keys it split)."""
    return jnp.zeros((count, *like.shape), like.dtype)


def initial_carry(window: Window, shapes: Shapes, given: Any = None) -> Carry:
    """The carry before the first tick: fills, an empty ring (of the
    schedule's ``ring_size``, slots like the residuals of the stage on
    ``given``, by default ``stage_given(device, 0)``), zero sums."""
    device = window.device
    given = stage_given(device, 0) if given is None else given
    saved = jax.eval_shape(
        lambda g, x: forward(stage_call(device), g, x)[1], given, device.fill
    )
    ring = [ring_slots(s, ticks_of(device).ring_size) for s in saved]
    zero_grads = jax.tree.map(
        jnp.zeros_like, (device.embed, device.stages, device.head)
    )
    message = Message(
        floats(fill_like(shapes.x, 0.0)), jnp.zeros((), window.share_dtype)
    )
    carry = Carry(device.fill, message, ring, zero_grads, device.no_loss)
    return varying(carry, axes_of(device))


def make_window(
    static: Static, skip: bool, params: tuple, batch: Batch, key: Any, loss_scale: Any
) -> Window:
    """What a device's ticks read (a :class:`Window`), under ``shard_map``:
    its :class:`~jaxaccum._pipeline._device.Device`, the loss scale, the
    window's ``M D`` micro-batch pieces, the options."""
    options, shapes = static.options, static.shapes
    device = make_device(static, params, batch, key)
    layout = options.layout
    shards = lax.axis_size(layout.data_axis) if layout.data_axis else 1
    return Window(
        device,
        loss_scale,
        static.schedule.num_microbatches * shards,
        skip,
        probed_options(options),
        [],
        share_dtype(shapes.loss.loss),
    )


def run_window(
    static: Static, skip: bool, params: tuple, batch: Batch, key: Any, loss_scale: Any
):
    """One device's 1F1B window under ``shard_map``.

    Returns the :class:`LossOut` summed over micro-batches and devices, the
    per-micro-batch loss and weight (``(1, 1, M)``), the gradients (at each
    micro-batch's share and the loss scale; with ``"weighted"`` of the loss
    sum), reduced, and the :class:`Probes` (``(1, 1, .)`` squared norms of
    the loss's own gradient pieces, zeros unless probed).
    """
    options, schedule = static.options, static.schedule
    window = make_window(static, skip, params, batch, key, loss_scale)
    device = window.device
    carry, per_tick = lax.scan(
        functools.partial(one_tick, window),
        initial_carry(window, static.shapes),
        jnp.arange(schedule.num_ticks),
        unroll=options.unroll,
    )
    return window_results(carry, per_tick, ticks_of(device), static.fsdp_dims, options)


def window_results(
    carry: Any, per_tick: tuple, schedule: RingTicks, fsdp_dims, options
):
    """The loop's carry and per-tick outputs as :func:`run_window` returns
    them: each micro-batch's loss and head probe from its loss tick, its
    embedding probe from its embedding backward's (the schedule's
    ``loss_ticks`` and ``embed_ticks``)."""
    num = schedule.num_microbatches
    loss, weight, embed_sq, stage_sq, head_sq = per_tick
    losses, embeds = schedule.loss_ticks(), schedule.embed_ticks()

    def on(x: PyTree, ticks: np.ndarray) -> Any:
        return jax.tree.map(lambda y: y[ticks].reshape(1, 1, num), x)

    per_micro = LossOut(on(loss, losses), on(weight, losses), ())
    probes = Probes(
        on(embed_sq, embeds), stage_sq.reshape(1, 1, -1), on(head_sq, losses)
    )
    sums = lax.psum(carry.sums, options.layout.manual_axes)
    grads = reduced(carry.grads, fsdp_dims, options)
    return sums, per_micro, grads, probes
