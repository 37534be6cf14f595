"""Zero-bubble in one program (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024; their ZB-H1 in lockstep): each stage's backward is
split into its input part B (the stage input's cotangent, the one the stage
before waits for; split at the jaxpr by ``_zero_bubble_split``) and its
weight part W (the stage parameters' gradient, from the boundary B stored),
and each tick gives a device an F, a B and a W slot where the tables
(:class:`Grid`, built when the step is traced) put a micro-batch, with both
neighbour permutes. Without remat (F = B = W) the tables are a grid of one
slot a tick (:func:`_one_slot`): B first, then F while the device holds
fewer than ``S - d`` micro-batches between F and B, then W, which it must
run once ``S`` are held between their F and their W (ZB-H1's activation
memory: a ring of ``S`` residual slots, under 1F1B's ``2 S - 1``); its
modeled window is within a tick of the asynchronous ZB-H1's ``3 M + S -
1`` for ``M >= S``. With remat B recomputes the forward (B =
2 F) and a grid would pay a B's tick on every tick: F and B keep 1F1B's
ticks and each W is deferred into a tick it does not lengthen
(:func:`_deferred_weights`). Activations and cotangents that arrive before
their slot wait in inboxes."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._schedule import Tick
from jaxaccum._pipeline._zero_bubble_tick import run_window


class Grid(NamedTuple):
    """A zero-bubble window's tables, ``(S, T)`` ints: the micro-batch
    whose F, B or W each device runs at each tick, or -1; and the slots
    its rings and inboxes need (each the most a device holds at once).

    Attributes:
      forward: the F table.
      backward: the B table.
      weight: the W table.
      ring_size: residuals held from F to W.
      stored_size: boundaries held from B to W.
      inbox_size: activations held from their arrival to their F.
      back_size: cotangents held from their arrival (on the last device,
        the loss's, from its F) to their B.
      x_arrival: the micro-batch whose activation arrives at each tick, or
        -1 (the previous device's F of the tick before).
      back_arrival: the micro-batch whose cotangent arrives at each tick,
        or -1 (the next device's B of the tick before).
      immediate: whether every activation and cotangent is used in the
        tick it arrives (the last device's loss cotangent in its F's): the
        inboxes are not needed.
    """

    forward: np.ndarray
    backward: np.ndarray
    weight: np.ndarray
    ring_size: int
    stored_size: int
    inbox_size: int
    back_size: int
    x_arrival: np.ndarray
    back_arrival: np.ndarray
    immediate: bool


def _one_slot(num_stages: int, num: int) -> tuple[np.ndarray, ...]:
    """The F, B and W tables of one slot a tick, tick by tick: a device
    runs its oldest pending W first when it holds ``S`` micro-batches
    between their F and their W (its residual ring is full) and one has had
    its B; else its next B when its F is done and the cotangent has arrived
    (a tick after the next device's B; on the last device a tick after its
    F); else its next F when the activation has arrived and it holds fewer
    than ``S - d`` between F and B and fewer than ``S`` between F and W;
    else its next W. The ring is ``min(S, M)`` slots, the stored boundaries
    fewer, the window within a tick of ZB-H1's ``3 M + S - 1``."""
    stages = range(num_stages)
    f_at = np.full((num_stages, num), 1 << 30)
    b_at = np.full((num_stages, num), 1 << 30)
    nf, nb, nw = (np.zeros(num_stages, int) for _ in range(3))
    columns = []
    tick = 0
    while (nw < num).any():
        column = np.full((3, num_stages), -1)
        for d in stages:
            f, b = nf[d], nb[d]
            if f - nw[d] >= num_stages and nw[d] < b:
                column[2, d] = nw[d]
            elif (
                b < num
                and f_at[d, b] < tick
                and (d == num_stages - 1 or b_at[d + 1, b] < tick)
            ):
                column[1, d] = b
            elif (
                f < num
                and (d == 0 or f_at[d - 1, f] < tick)
                and f - b < num_stages - d
                and f - nw[d] < num_stages
            ):
                column[0, d] = f
            elif nw[d] < b:
                column[2, d] = nw[d]
        for d in stages:
            if column[0, d] >= 0:
                f_at[d, nf[d]], nf[d] = tick, nf[d] + 1
            if column[1, d] >= 0:
                b_at[d, nb[d]], nb[d] = tick, nb[d] + 1
            nw[d] += column[2, d] >= 0
        columns.append(column)
        tick += 1
    return tuple(np.stack(columns, axis=-1))  # 3 x (S, T)


def _held(start: np.ndarray, end: np.ndarray) -> int:
    """The most micro-batches a device holds at once, each from its tick
    in ``start`` (``(S, M)``) to its tick in ``end``, both inclusive: a
    slot read in a tick is free from the next (one written in the same
    tick, before the read, would need a slot of its own)."""
    ticks = np.arange(int(end.max()) + 1)[:, None, None]
    live = (start[None] <= ticks) & (ticks <= end[None])
    return int(live.sum(axis=-1).max())


def _slot_ticks(table: np.ndarray) -> np.ndarray:
    """``(S, M)``: the tick of each device's slot of each micro-batch."""
    stages, num = table.shape[0], int(table.max()) + 1
    at = np.zeros((stages, num), int)
    for d in range(stages):
        ticks = np.flatnonzero(table[d] >= 0)
        at[d, table[d, ticks]] = ticks
    return at


def _deferred_weights(num_stages: int, num: int) -> tuple[np.ndarray, ...]:
    """The F, B and W tables with F and B at 1F1B's ticks and the W's
    placed greedily, tick by tick: a device runs its oldest pending W (its
    B done, in this tick or before) when that does not lengthen the tick
    (its F and B leave room under the busiest device's), in a tick after
    1F1B's, or when its slots are due: micro-batch ``m``'s residual slot is
    ``m + K``'s from that one's F (tick ``m + K + d``), its boundary's slot
    ``m + K``'s from that one's B (tick ``m + K + 2 (S - 1) - d``). Its
    modeled window is the integer program's optimum for this placement
    (``benchmarks/pipeline_zero_bubble.py``)."""
    one = OneFOneB(num_stages, num)
    busy, ring, lag = one.busy_table(), one.ring_size, one.lag
    mandatory = (busy % 2 == 1).astype(int) + (busy >= 2).astype(int)  # F + B
    stage = np.arange(num_stages)
    done = np.zeros(num_stages, int)  # the W's each device has run
    columns = []
    tick = 0
    while (done < num).any():
        own = mandatory[:, tick] if tick < one.num_ticks else np.zeros_like(done)
        ready = done < np.clip(tick - 2 * lag + stage + 1, 0, num)
        due = (done + ring < num) & (done + ring + stage <= tick + 1)
        due |= (done + ring < num) & (done + ring + 2 * lag - stage <= tick + 1)
        due &= ready
        longest = (own + due).max()
        runs = ready & (due | (own + 1 <= longest) | (longest == 0))
        columns.append(np.where(runs, done, -1))
        done = done + runs
        tick += 1
    weight = np.stack(columns, axis=1)
    ticks = np.arange(weight.shape[1])[None, :]
    forward = ticks - stage[:, None]
    backward = ticks - 2 * lag + stage[:, None]
    forward = np.where((forward >= 0) & (forward < num), forward, -1)
    backward = np.where((backward >= 0) & (backward < num), backward, -1)
    return forward, backward, weight


@functools.lru_cache(maxsize=256)
def grid(num_stages: int, num_microbatches: int, recomputes: bool = False) -> Grid:
    """The :class:`Grid` of ``S`` devices and ``M`` micro-batches: one slot
    a tick, or with ``recomputes`` (remat) 1F1B's ticks and deferred W's."""
    build = _deferred_weights if recomputes else _one_slot
    forward, backward, weight = build(num_stages, num_microbatches)
    f_at, b_at, w_at = (_slot_ticks(t) for t in (forward, backward, weight))
    arrives = np.concatenate([f_at[:1], f_at[:-1] + 1])  # the first: embedded
    handed = np.concatenate([b_at[1:] + 1, f_at[-1:]])  # the last: its loss
    x_arrival, back_arrival = np.full_like(forward, -1), np.full_like(forward, -1)
    x_arrival[1:, 1:], back_arrival[:-1, 1:] = forward[:-1, :-1], backward[1:, :-1]
    for table in (forward, backward, weight, x_arrival, back_arrival):
        table.flags.writeable = False
    return Grid(
        forward,
        backward,
        weight,
        _held(f_at, w_at),
        _held(b_at, w_at),
        _held(arrives, f_at),
        _held(handed, b_at),
        x_arrival,
        back_arrival,
        bool((arrives == f_at).all() and (handed == b_at).all()),
    )


def _column(table: np.ndarray, tick: Any, stage: Any) -> tuple[Any, Any]:
    micro = jnp.asarray(table)[stage, tick]
    return micro >= 0, jnp.maximum(micro, 0)


@dataclasses.dataclass(frozen=True)
class ZeroBubble(OneFOneB):
    """Zero-bubble in one program on its :func:`grid`: without remat one F,
    B or W slot per device a tick, ``3 M + S`` ticks for ``M >= S > 1``
    (``3 M + S - 1`` to the last F and B, then one of W);
    with remat (``recomputes``) 1F1B's ticks and W's deferred, then ticks
    of W slots only (those after the last F and B are a loop without
    permutes). The activation memory is a ring of residual slots
    (``min(S, M)`` without remat, 1F1B's ``min(2 S - 1, M)`` with), a ring
    of B's boundaries (at most ``S - 1`` slots without remat, ``min(2 S -
    1, M)`` with; for a stage of ``L`` dense layers, ``L`` activations a
    slot) and, without remat, the inboxes (an activation each).
    ``repeats=1`` only.

    Attributes:
      recomputes: whether B recomputes the stage's forward (remat), which
        chooses the tables.
    """

    name: ClassVar[str] = "zero-bubble"
    recomputes: bool = False

    @classmethod
    def for_window(
        cls, num_stages: int, num_microbatches: int, repeats: int, remat: Any
    ) -> "ZeroBubble":
        """The schedule of a window with ``remat``: True or a checkpoint
        policy recomputes; False and None (no remat, as everywhere) do not."""
        return cls(num_stages, num_microbatches, repeats, bool(remat))

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        if repeats > 1:
            raise ValueError(
                f"schedule='zero-bubble' with repeats={repeats} is not built: "
                "its grid runs one stage per device. Use repeats=1 with "
                "'zero-bubble' or '1f1b', or schedule='1f1b' with repeats > 1 "
                "(interleaved) or 'gpipe' (circular)."
            )

    def grid(self) -> Grid:
        """The schedule's :class:`Grid`."""
        return grid(self.num_stages, self.num_microbatches, self.recomputes)

    @property
    def ring_size(self) -> int:
        """The residual slots a device keeps: ``min(S, M)`` (``min(2 S - 1,
        M)`` with remat)."""
        return self.grid().ring_size

    @property
    def stored_size(self) -> int:
        """The stored boundaries' slots: at most ``max(S - 1, 1)`` (``K``
        with remat)."""
        return self.grid().stored_size

    def weight_table(self) -> np.ndarray:
        """``(S, T)``: the micro-batch whose W each device runs at each tick,
        or -1."""
        return self.grid().weight

    @property
    def loop_ticks(self) -> int:
        """The ticks up to the last F or B, each with both permutes."""
        grid = self.grid()
        busy = ((grid.forward >= 0) | (grid.backward >= 0)).any(axis=0)
        return int(np.flatnonzero(busy)[-1]) + 1

    @property
    def num_ticks(self) -> int:
        """The grid's ticks, the loop's and the W slots' after it."""
        return int(self.grid().weight.shape[1])

    def at(self, tick: Any, stage: Any) -> Tick:
        """The F slot of the device of ``stage`` at ``tick``."""
        valid, micro = _column(self.grid().forward, tick, stage)
        zero = jnp.zeros_like(micro)
        return Tick(
            valid=valid,
            microbatch=micro,
            repeat=zero,
            layer=zero + stage,
            enters=valid & (stage == 0),
            exits=valid & (stage == self.num_stages - 1),
        )

    def backward_at(self, tick: Any, stage: Any) -> tuple[Any, Any]:
        """Whether the device of ``stage`` runs a B slot at ``tick``, and the
        micro-batch's (0 where not)."""
        return _column(self.grid().backward, tick, stage)

    def busy_table(self) -> np.ndarray:
        """An F, a B and a W slot, 1 each, where they carry a micro-batch (a
        device's idle ticks are skipped)."""
        grid = self.grid()
        tables = (grid.forward, grid.backward, grid.weight)
        return np.sum([(table >= 0) * 1.0 for table in tables], axis=0)

    @property
    def bubble_fraction(self) -> float:
        """The share of the modeled window a device is idle, ``1 - 3 M /
        window``: without remat ``S / (3 M + S)`` for ``M >= S > 1``."""
        return 1.0 - self.useful_work / self.modeled_window()

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its W slot's."""
        return self.weight_table()[..., None] == np.arange(self.num_microbatches)

    def loss_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the last device takes each micro-batch's loss
        (its F)."""
        return _slot_ticks(self.grid().forward)[-1]

    def embed_ticks(self) -> np.ndarray:
        """``(M,)``: the tick the first device runs each micro-batch's
        embedding backward (its B)."""
        return _slot_ticks(self.grid().backward)[0]

    def device_window(self) -> Callable[..., tuple]:
        """One device's window under ``shard_map``: the zero-bubble
        :func:`~jaxaccum._pipeline._zero_bubble_tick.run_window`."""
        return run_window
