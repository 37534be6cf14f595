"""The V-shaped zero-bubble schedule in one program (Qi et al., "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024; PyTorch's ZBV):
``schedule="v-zb"`` with ``repeats=2``. The ``2 S`` model stages go down
the ``S`` devices and back up: device ``d`` holds stage ``d`` and stage
``2 S - 1 - d``, so the embedding and the loss are both on device 0 and the
V's tip stays on device ``S - 1``. Each stage's backward is split into B
and W as zero-bubble's is; each tick a device runs one F, B or W of one of
its two chunks (the greedy tables of ``_v_tables``, at most ``2 S`` chunk
activations held from F to W), with four neighbour permutes.

The stacked stage parameters in model order (``2 S`` of them, stage ``i``
at index ``i``) are laid out ``(2, S, ...)`` as interleaved 1F1B's are
(device ``d`` gets stages ``d`` and ``S + d``); the device body mirrors the
second row over the stage axis by one permute before its loop (device
``d`` then holds stage ``2 S - 1 - d``) and the gradient back by one after
it. In device order (``stage_order="device"``) the second row already is
stage ``2 S - 1 - d``: nothing moves. Without remat only.

``schedule="v-half"`` is the same program with fewer chunk activations held
(Qi et al.'s V-Half): the least cap whose modeled window is no longer than
lockstep 1F1B's (``_v_tables.half_plan``; 5 at S = 4, against V-ZB's 8)."""

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._schedule import Tick
from jaxaccum._pipeline._v_shape_tick import run_window
from jaxaccum._pipeline._v_tables import B, F, VTables, half_plan, op_ticks, v_tables


@dataclasses.dataclass(frozen=True)
class VShape(OneFOneB):
    """V-ZB: ``schedule="v-zb"``, ``repeats=2``, no remat. Its window is
    the tables' ticks, each one chunk's F, B or W (half a stage's: at S =
    4, M = 16, 100 ticks, 50 stages' forward against 1F1B's 57); its ring
    holds at most ``2 S`` chunk activations (``S`` stages', the
    asynchronous 1F1B's), besides the stored boundaries and the inboxes."""

    name: ClassVar[str] = "v-zb"

    @classmethod
    def check_remat(cls, remat: Any) -> None:
        """Refuses remat: not built."""
        if remat:
            raise ValueError(
                f"schedule='{cls.name}' with remat is not built: its tables assume "
                "F = B = W and its B does not recompute the forward. Use "
                "remat=False, or schedule='zero-bubble' or '1f1b' with remat."
            )

    @classmethod
    def stage_on(cls, num_stages: int, device: int, repeat: int) -> int:
        """Down the V then back up: stage ``d``, then ``2 S - 1 - d``."""
        return device if repeat == 0 else 2 * num_stages - 1 - device

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        if repeats != 2:
            raise ValueError(
                f"schedule='{cls.name}' runs repeats=2 only (two chunks a device, "
                f"down and back up the V), got repeats={repeats}: stack 2 S "
                "stages and pass repeats=2."
            )

    @property
    def loss_device(self) -> int:
        """Device 0 takes the loss (the up chunk ends where the V began)."""
        return 0

    def tables(self) -> VTables:
        """The schedule's :class:`~jaxaccum._pipeline._v_tables.VTables`."""
        return v_tables(self.num_stages, self.num_microbatches)

    @property
    def ring_size(self) -> int:
        """The residual slots a device keeps, at most ``2 S``."""
        return self.tables().ring_size

    @property
    def stored_size(self) -> int:
        """The stored boundaries' slots."""
        return self.tables().stored_size

    @property
    def loop_ticks(self) -> int:
        """The ticks up to the last F or B, each with the four permutes."""
        return self.tables().loop_ticks

    @property
    def num_ticks(self) -> int:
        """The tables' ticks, the loop's and the W's after it."""
        return int(self.tables().op.shape[1])

    def at(self, tick: Any, stage: Any) -> Tick:
        """The F slot of the device of ``stage`` at ``tick`` (its repeat the
        chunk: 0 down, 1 up)."""
        tables = self.tables()
        valid = jnp.asarray(tables.op)[stage, tick] == F
        micro = jnp.asarray(tables.micro)[stage, tick]
        chunk = jnp.asarray(tables.chunk)[stage, tick]
        first = stage == 0
        return Tick(
            valid=valid,
            microbatch=micro,
            repeat=chunk,
            layer=jnp.where(chunk == 0, stage, 2 * self.num_stages - 1 - stage),
            enters=valid & first & (chunk == 0),
            exits=valid & first & (chunk == 1),
        )

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]:
        """Whether the device of ``stage`` runs a B at ``tick``, and its
        micro-batch."""
        tables = self.tables()
        valid = jnp.asarray(tables.op)[stage, tick] == B
        return valid, jnp.asarray(tables.micro)[stage, tick]

    def busy_table(self) -> np.ndarray:
        """1 where a device runs an op: a chunk's F, B or W, each about a
        forward of one model stage (``1/2`` of a device's layers)."""
        return (self.tables().op >= 0) * 1.0

    @property
    def bubble_fraction(self) -> float:
        """The share of the modeled window a device is idle."""
        return 1.0 - self.useful_work / self.modeled_window()

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its W's (either chunk's)."""
        tables = self.tables()
        micro = np.where(tables.op == 2, tables.micro, -1)
        return micro[..., None] == np.arange(self.num_microbatches)

    def _op_ticks(self) -> np.ndarray:
        tables = self.tables()
        d = np.arange(self.num_stages)[:, None]
        stage = np.where(tables.chunk == 1, 2 * self.num_stages - 1 - d, d)
        plan = np.stack([tables.op, tables.micro, stage])
        return op_ticks(plan, self.num_stages, self.num_microbatches)

    def loss_ticks(self) -> np.ndarray:
        """``(M,)``: the tick device 0 takes each loss (its up chunk's F)."""
        return self._op_ticks()[F, -1]

    def embed_ticks(self) -> np.ndarray:
        """``(M,)``: the tick device 0 runs each embedding backward (its down
        chunk's B)."""
        return self._op_ticks()[B, 0]

    def device_window(self) -> Callable[..., tuple]:
        """One device's window: :func:`~jaxaccum._pipeline._v_shape_tick.
        run_window`."""
        return run_window


@dataclasses.dataclass(frozen=True)
class VHalf(VShape):
    """V-Half: ``schedule="v-half"``, ``repeats=2``, no remat. V-ZB's
    program with a device holding fewer chunk activations
    (:func:`~jaxaccum._pipeline._v_tables.half_plan`): the least cap whose
    modeled window is no longer than lockstep 1F1B's, of two orders of
    ready B's (at S = 4: 5 chunks, 2.5 stages' against 1F1B's ring of 7),
    the same for every ``M`` from ``2`` up (measured to ``16 S``)."""

    name: ClassVar[str] = "v-half"

    def tables(self) -> VTables:
        """The tables of :func:`~jaxaccum._pipeline._v_tables.half_plan`."""
        stages, num = self.num_stages, self.num_microbatches
        return v_tables(stages, num, *half_plan(stages, num))
