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
    """

    num_stages: int
    num_microbatches: int
    repeats: int

    @property
    def num_ticks(self) -> int:
        """``M R + S - 1``: each device runs ``M R`` iterations, the last
        device starting ``S - 1`` ticks after the first."""
        return self.num_microbatches * self.repeats + self.num_stages - 1

    @property
    def bubble_fraction(self) -> float:
        """``(S - 1) / (M R + S - 1)``: the share of a device's ticks idle."""
        return (self.num_stages - 1) / self.num_ticks

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
    schedule = Schedule(mesh.shape[layout.stage_axis], num, layout.repeats)
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
