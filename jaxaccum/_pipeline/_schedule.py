"""The pipeline's schedule: which micro-batch and stage each device runs
at each tick of the window."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._options import AccumOptions


class Schedule(NamedTuple):
    """The ticks of one window: ``M`` micro-batches through ``S`` stage
    devices, each holding ``R`` stages (circular when ``R > 1``).

    Attributes:
      num_stages: ``S``, the size of the stage axis.
      num_microbatches: ``M``.
      repeats: ``R``; model stage ``r S + d`` runs on device ``d``.
      kind: ``"gpipe"`` (every forward pass, then autodiff's backward) or
        ``"1f1b"`` (each tick a forward and a backward slot per device).
    """

    num_stages: int
    num_microbatches: int
    repeats: int
    kind: str = "gpipe"

    @property
    def num_ticks(self) -> int:
        """GPipe: ``M R + S - 1`` (each device runs ``M R`` iterations, the
        last device starting ``S - 1`` ticks after the first). 1F1B: ``M +
        2 (S - 1)``, a micro-batch's backward leaving the first stage
        ``2 (S - 1)`` ticks after its forward entered it."""
        if self.kind == "1f1b":
            return self.num_microbatches + 2 * (self.num_stages - 1)
        return self.num_microbatches * self.repeats + self.num_stages - 1

    @property
    def bubble_fraction(self) -> float:
        """``(S - 1) / (M R + S - 1)``: the share of a device's time idle,
        for either schedule. GPipe's forward and backward loops each idle
        ``S - 1`` of their ticks; 1F1B's first ``S - 1`` ticks run forward
        slots only, its last ``S - 1`` backward slots only (the slots of a
        bubble skipped), so it takes ``(M + S - 1)`` forward-and-backward
        times too."""
        ticks = self.num_microbatches * self.repeats + self.num_stages - 1
        return (self.num_stages - 1) / ticks

    @property
    def ring_size(self) -> int:
        """1F1B: the stage inputs (or residuals) a device keeps, ``min(2 S -
        1, M)``: stage ``d`` holds micro-batch ``m`` from its forward at tick
        ``m + d`` to its backward at tick ``m + 2 (S - 1) - d``."""
        return min(2 * self.num_stages - 1, self.num_microbatches)

    @property
    def recirculation_delay(self) -> int:
        """Ticks an activation leaving the last stage waits before the first
        stage runs its next repeat: ``M - S`` (a buffer of that many)."""
        return self.num_microbatches - self.num_stages if self.repeats > 1 else 0

    def at(self, tick: jax.Array, stage: jax.Array) -> "Tick":
        """What the device of ``stage`` does at ``tick``."""
        total = self.num_microbatches * self.repeats
        iteration = tick - stage
        valid = (iteration >= 0) & (iteration < total)
        safe = jnp.clip(iteration, 0, total - 1)
        repeat = safe // self.num_microbatches
        return Tick(
            valid=valid,
            microbatch=safe % self.num_microbatches,
            repeat=repeat,
            layer=repeat * self.num_stages + stage,
            enters=valid & (stage == 0) & (repeat == 0),
            exits=valid & (stage == self.num_stages - 1) & (repeat == self.repeats - 1),
        )

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]:
        """1F1B: whether the device of ``stage`` runs a backward slot at
        ``tick``, and the micro-batch's (clipped in a bubble)."""
        iteration = tick - 2 * (self.num_stages - 1) + stage
        valid = (iteration >= 0) & (iteration < self.num_microbatches)
        return valid, jnp.clip(iteration, 0, self.num_microbatches - 1)


class Tick(NamedTuple):
    """One device's work at one tick (traced scalars).

    Attributes:
      valid: False in a bubble.
      microbatch: the micro-batch it carries (clipped in a bubble).
      repeat: the repeat of its stage (clipped in a bubble).
      layer: the model stage it applies, ``repeat * S + stage``.
      enters: the first stage's first repeat: the micro-batch enters.
      exits: the last stage's last repeat: the micro-batch leaves, its
        activation is the one its loss is taken on.
    """

    valid: jax.Array
    microbatch: jax.Array
    repeat: jax.Array
    layer: jax.Array
    enters: jax.Array
    exits: jax.Array


def schedule_on(mesh: Any, options: AccumOptions) -> Schedule:
    """The window's schedule on ``mesh``; ``M < S`` with ``R > 1`` is refused."""
    layout = options.layout
    num = options.num_microbatches
    assert num is not None, "the step resolves microbatch_size to M first"
    schedule = Schedule(
        mesh.shape[layout.stage_axis], num, layout.repeats, layout.schedule
    )
    if layout.repeats > 1 and num < schedule.num_stages:
        raise ValueError(
            f"repeats={layout.repeats} needs num_microbatches >= the "
            f"{schedule.num_stages} stages, got {num}: a "
            "micro-batch leaving the last stage re-enters the first stage "
            "M ticks after it first entered, which must not be before the "
            f"first stage has passed it on. Use M >= {schedule.num_stages}, "
            "or repeats=1 (any M; the bubble is then "
            f"{schedule.num_stages - 1} of every "
            f"{num + schedule.num_stages - 1} ticks)."
        )
    return schedule
