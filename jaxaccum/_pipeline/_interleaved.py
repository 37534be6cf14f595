"""Interleaved 1F1B in one program (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
SC 2021; here in lockstep): ``schedule="1f1b"`` with ``repeats=R > 1``.
Device ``d`` holds model stages ``d, S + d, ..., (R - 1) S + d`` and every
tick runs a forward slot and a backward slot of one of them (a chunk:
``1/R`` of the device's layers).

Forward iteration ``i`` (device ``d`` runs it at tick ``i + d``) carries
micro-batch ``g S + i % S`` through repeat ``(i % S R) // S``, with ``g = i
// (S R)``: micro-batches go in groups of ``S``, each group through every
repeat before the next group starts. An activation leaving the last device
in repeat ``r`` at tick ``i + S - 1`` is the first device's input for
repeat ``r + 1`` at iteration ``i + S``, the next tick: the forward ring is
circular and nothing waits. Backward iteration ``j`` decomposes alike with
the repeats reversed and runs at tick ``j + lag + S - 1 - d``, ``lag = R S -
1`` (the last repeat's backward starts on the last device in the tick its
loss is taken); the cotangent ring is circular too. A group short of ``S``
micro-batches (``M`` not a multiple of ``S``) keeps its bubble slots,
skipped. Each device keeps its forwards' residuals in a ring whose slots a
table assigns (:func:`tables`), as many as it ever has in flight."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._interleaved_tick import run_window
from jaxaccum._pipeline._schedule import Tick


class Slot(NamedTuple):
    """A forward or backward slot of the interleaved schedule (numpy or
    traced arrays alike).

    Attributes:
      valid: False in a bubble (before, after, or a padded group's slot).
      microbatch: its micro-batch (clipped in a bubble).
      repeat: its repeat (clipped in a bubble).
    """

    valid: Any
    microbatch: Any
    repeat: Any


def decomposed(iteration: Any, stages: int, num: int, repeats: int, back: bool) -> Slot:
    """Iteration ``iteration`` of a device's ``ceil(M / S) S R`` as its
    (micro-batch, repeat): groups of ``S`` micro-batches, each through the
    repeats in order (``back``: reversed) before the next group."""
    total = -(-num // stages) * stages * repeats
    valid = (iteration >= 0) & (iteration < total)
    safe = iteration.clip(0, total - 1)
    within = safe % (stages * repeats)
    microbatch = (safe // (stages * repeats)) * stages + safe % stages
    repeat = within // stages
    if back:
        repeat = repeats - 1 - repeat
    return Slot(valid & (microbatch < num), microbatch.clip(0, num - 1), repeat)


class Tables(NamedTuple):
    """The interleaved schedule's ``(S, T)`` tables (numpy, read-only).

    Attributes:
      forward: the forward :class:`Slot` of each device at each tick.
      backward: the backward :class:`Slot`.
      forward_slot: the ring slot the forward writes its residuals to (0 in
        a bubble).
      backward_slot: the ring slot the backward reads them from.
      ring_size: the slots a device needs: the most forwards it ever has
        in flight (a slot freed by a backward is reused from the next tick:
        in a tick the forward writes before the backward reads).
    """

    forward: Slot
    backward: Slot
    forward_slot: np.ndarray
    backward_slot: np.ndarray
    ring_size: int


def _ring_slots(forward: Slot, backward: Slot) -> tuple[np.ndarray, np.ndarray]:
    """Each forward's residual slot and each backward's, per device: the
    lowest slot free at the forward's tick (freed the tick after its
    backward read it)."""
    stages, ticks = forward.valid.shape
    written = np.zeros((stages, ticks), np.int32)
    read = np.zeros((stages, ticks), np.int32)
    for stage in range(stages):
        held: dict[tuple[int, int], int] = {}
        for tick in range(ticks):
            if forward.valid[stage, tick]:
                free = sorted(set(range(len(held) + 1)) - set(held.values()))[0]
                pair = (forward.microbatch[stage, tick], forward.repeat[stage, tick])
                held[pair] = written[stage, tick] = free
            if backward.valid[stage, tick]:
                pair = (backward.microbatch[stage, tick], backward.repeat[stage, tick])
                read[stage, tick] = held.pop(pair)
    return written, read


@functools.lru_cache(maxsize=256)
def tables(num_stages: int, num_microbatches: int, repeats: int) -> Tables:
    """The :class:`Tables` of ``S`` devices, ``M`` micro-batches, ``R``
    repeats (built once per configuration, when a step is traced)."""
    schedule = Interleaved(num_stages, num_microbatches, repeats)
    tick = np.arange(schedule.num_ticks)[None, :]
    stage = np.arange(num_stages)[:, None]
    lag = schedule.lag
    shape = (num_stages, num_microbatches, repeats)
    forward = decomposed(tick - stage, *shape, back=False)
    backward = decomposed(tick - lag - (num_stages - 1 - stage), *shape, back=True)
    written, read = _ring_slots(forward, backward)
    size = int(written.max()) + 1
    for array in (*forward, *backward, written, read):
        array.flags.writeable = False
    return Tables(forward, backward, written, read, size)


@dataclasses.dataclass(frozen=True)
class Interleaved(OneFOneB):
    """Interleaved 1F1B: ``schedule="1f1b"`` with ``repeats=R > 1``. Each
    tick a forward and a backward slot of one of the device's ``R`` stages,
    ``ceil(M / S) S R + R S + S - 2`` ticks; the modeled window (in one
    stage's forward, ``1/R`` of 1F1B's at the same model) is ``3 M R + 3 (S
    - 1)`` for ``M`` a multiple of ``S``: the fill and drain cost ``1/R`` of
    1F1B's. Its activation ring (:attr:`ring_size`) is flat in ``M``."""

    name: ClassVar[str] = "1f1b"

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        """Every ``repeats`` is built (``R = 1`` is 1F1B's ticks)."""
        del repeats

    @property
    def padded(self) -> int:
        """``M`` rounded up to whole groups of ``S``."""
        return -(-self.num_microbatches // self.num_stages) * self.num_stages

    @property
    def lag(self) -> int:
        """``R S - 1``: the last device takes micro-batch ``g S``'s loss
        ``R S - 1`` ticks after backward iteration ``g S R`` would start."""
        return self.repeats * self.num_stages - 1

    @property
    def num_ticks(self) -> int:
        """``ceil(M / S) S R + lag + S - 1``: the last backward leaves the
        first device ``S - 1`` ticks after it left the last."""
        return self.padded * self.repeats + self.lag + self.num_stages - 1

    def tables(self) -> Tables:
        """The schedule's :class:`Tables`."""
        return tables(self.num_stages, self.num_microbatches, self.repeats)

    @property
    def ring_size(self) -> int:
        """The residual slots a device keeps (:attr:`Tables.ring_size`):
        ``(R + 1) S - 1`` or fewer, ``1/R`` of a device's stage each."""
        return self.tables().ring_size

    def _shape(self) -> tuple[int, int, int]:
        return self.num_stages, self.num_microbatches, self.repeats

    def at(self, tick: Any, stage: Any) -> Tick:
        """The forward slot of the device of ``stage`` at ``tick``."""
        slot = decomposed(tick - stage, *self._shape(), back=False)
        last = self.num_stages - 1
        return Tick(
            valid=slot.valid,
            microbatch=slot.microbatch,
            repeat=slot.repeat,
            layer=slot.repeat * self.num_stages + stage,
            enters=slot.valid & (stage == 0) & (slot.repeat == 0),
            exits=slot.valid & (stage == last) & (slot.repeat == self.repeats - 1),
        )

    def backward_slot(self, tick: Any, stage: Any) -> Slot:
        """The backward slot of the device of ``stage`` at ``tick``."""
        iteration = tick - self.lag - (self.num_stages - 1 - stage)
        return decomposed(iteration, *self._shape(), back=True)

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]:
        """Whether the device of ``stage`` runs a backward slot at ``tick``,
        and the micro-batch's (clipped in a bubble)."""
        slot = self.backward_slot(tick, stage)
        return slot.valid, slot.microbatch

    def forward_ring(self) -> list[tuple[int, int]]:
        """The activations' permute: round the ring, last device to first."""
        return [(d, (d + 1) % self.num_stages) for d in range(self.num_stages)]

    def backward_ring(self) -> list[tuple[int, int]]:
        """The cotangents' permute: round the ring, first device to last."""
        return [((d + 1) % self.num_stages, d) for d in range(self.num_stages)]

    def busy_table(self) -> np.ndarray:
        """A forward slot (1: one stage, ``1/R`` of a device's) and a backward
        slot (2) where they carry a micro-batch (a bubble's, and a padded
        group's, are skipped)."""
        table = self.tables()
        return table.forward.valid * 1.0 + table.backward.valid * 2.0

    @property
    def bubble_fraction(self) -> float:
        """The share of the modeled window a device is idle, ``1 - 3 M R /
        window``: ``(S - 1) / (M R + S - 1)`` for ``M`` a multiple of ``S``
        (the padded group's skipped slots idle too)."""
        return 1.0 - self.useful_work / self.modeled_window()

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its backward slot's."""
        backward = self.tables().backward
        micro = np.where(backward.valid, backward.microbatch, -1)
        return micro[..., None] == np.arange(self.num_microbatches)

    def loss_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the last device takes each micro-batch's loss
        (and starts its backward)."""
        micro = np.arange(self.num_microbatches)
        iteration = (micro // self.num_stages) * self.num_stages * self.repeats
        iteration += (self.repeats - 1) * self.num_stages + micro % self.num_stages
        return iteration + self.num_stages - 1

    def embed_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the first device runs each micro-batch's
        embedding backward (its repeat 0's backward)."""
        return self.loss_ticks() + self.lag

    def device_window(self) -> Callable[..., tuple]:
        """One device's window under ``shard_map``: the interleaved
        :func:`~jaxaccum._pipeline._interleaved_tick.run_window`."""
        return run_window
