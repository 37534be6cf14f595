"""A pipeline schedule: the strategy a window's ticks follow. The base class
holds what every schedule shares (which device runs which forward iteration
at a tick, the neighbour permutations, the bubble); each schedule is a
subclass beside its device body (``_gpipe.GPipe``, ``_1f1b.OneFOneB``) that
owns its tick table, its ``shard_map`` and its result tail. ``_schedules``
maps a ``schedule=`` string to its class."""

import abc
import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Tick(NamedTuple):
    """One device's forward slot at one tick (traced scalars).

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


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
    """The ticks of one window: ``M`` micro-batches through ``S`` stage
    devices, each holding ``R`` stages (model stage ``r S + d`` on device
    ``d``).

    Attributes:
      num_stages: ``S``, the size of the stage axis.
      num_microbatches: ``M``.
      repeats: ``R``.
    """

    name: ClassVar[str]
    num_stages: int
    num_microbatches: int
    repeats: int = 1

    def __post_init__(self) -> None:
        self.check_repeats(self.repeats)
        self.check_window(self.num_stages, self.num_microbatches, self.repeats)

    @classmethod
    def for_window(
        cls, num_stages: int, num_microbatches: int, repeats: int, remat: Any
    ) -> "Schedule":
        """The schedule of a window with ``remat`` (the same for every
        ``remat`` unless a schedule says otherwise; one it is not built for
        refused by :meth:`check_remat`)."""
        cls.check_remat(remat)
        return cls(num_stages, num_microbatches, repeats)

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        """Refuses a ``repeats`` the schedule is not built for, saying why
        (every ``repeats`` is, unless a schedule says otherwise)."""
        del repeats

    @classmethod
    def stage_on(cls, num_stages: int, device: int, repeat: int) -> int:
        """The model stage device ``device`` runs as its ``repeat``-th:
        ``repeat S + device``."""
        return repeat * num_stages + device

    @classmethod
    def check_remat(cls, remat: Any) -> None:
        """Refuses a ``remat`` the schedule is not built for, saying why
        (every ``remat`` is, unless a schedule says otherwise)."""
        del remat

    @classmethod
    def check_window(cls, num_stages: int, num_microbatches: int, repeats: int) -> None:
        """Refuses a window of ``M`` micro-batches the schedule cannot run on
        ``S`` stages with ``repeats``, saying why (every ``M`` runs, unless a
        schedule says otherwise)."""
        del num_stages, num_microbatches, repeats

    @property
    def loss_device(self) -> int:
        """The index on the stage axis of the device that takes the loss
        (and holds the head): the last, ``-1``, unless a schedule says
        otherwise."""
        return -1

    @property
    @abc.abstractmethod
    def num_ticks(self) -> int:
        """The loop's length."""

    @abc.abstractmethod
    def busy_table(self) -> np.ndarray:
        """``(S, T)``: each device's work at each tick in units of one
        stage's forward pass (a backward pass 2), the slots it computes
        (a bubble computed on the fill counts; one skipped does not)."""

    def modeled_window(self) -> float:
        """The window's modeled time in units of one stage's forward pass:
        the ticks run in lockstep, each as long as its busiest device."""
        return float(self.busy_table().max(axis=0).sum())

    @property
    def useful_work(self) -> float:
        """A device's useful work in the window: a forward and a backward
        pass of each of its ``M R`` (micro-batch, repeat) pairs, ``3 M R``."""
        return 3.0 * self.num_microbatches * self.repeats

    @abc.abstractmethod
    def stage_gradient_table(self) -> np.ndarray:
        """``(S, T, M)`` bool: the micro-batch whose stage gradient device
        ``d`` computes at tick ``t`` (the statistics' per-tick probes)."""

    @abc.abstractmethod
    def differentiate(
        self, run: Any, params: tuple, batch: Any, key: Any, loss_scale: Any
    ) -> Any:
        """The window's sums and gradient on the mesh (traced under ``jit``):
        for the call's ``_run.Run`` (typed ``Any``: ``_run`` imports this
        module), the parameters laid out, the device body under
        ``shard_map``, its outputs as a ``_run.Raw``, the gradient the
        window's (at its share)."""

    @property
    def bubble_fraction(self) -> float:
        """``(S - 1) / (M R + S - 1)``: the share of a device's time idle (a
        schedule that runs its bubbles' slots counts them in its ticks)."""
        ticks = self.num_microbatches * self.repeats + self.num_stages - 1
        return (self.num_stages - 1) / ticks

    def at(self, tick: jax.Array, stage: jax.Array) -> Tick:
        """The forward slot of the device of ``stage`` at ``tick``: iteration
        ``tick - stage`` of its ``M R``."""
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

    def forward_ring(self) -> list[tuple[int, int]]:
        """The ``ppermute`` pairs handing each activation to the next stage's
        device (round the ring, last to first, when ``R > 1``)."""
        pairs = [(d, d + 1) for d in range(self.num_stages - 1)]
        return pairs + [(self.num_stages - 1, 0)] if self.repeats > 1 else pairs

    def backward_ring(self) -> list[tuple[int, int]]:
        """The ``ppermute`` pairs handing each cotangent to the previous
        stage's device."""
        return [(d + 1, d) for d in range(self.num_stages - 1)]

    def _table(self, iteration: np.ndarray) -> np.ndarray:
        """``(S, T, M)`` one-hot of ``iteration`` (``(S, T)``, ``M R`` valid)."""
        valid = (iteration >= 0) & (iteration < self.num_microbatches * self.repeats)
        micro = np.where(valid, iteration % self.num_microbatches, -1)
        return micro[..., None] == np.arange(self.num_microbatches)
