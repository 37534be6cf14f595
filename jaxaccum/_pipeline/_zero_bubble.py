"""Zero-bubble in one program (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024; the lockstep form of their ZB-H1): 1F1B's forward
and backward slots at 1F1B's ticks, with the same neighbour permutes, but
the backward slot computes only the stage input's cotangent (B, the one the
stage before waits for: its half of the stage's backward, split at the
jaxpr by ``_zero_bubble_split``) and stores what the other half reads (the
boundary: the cotangents inside the stage) in a second ring beside 1F1B's
residual ring. A third slot per tick, W, computes one micro-batch's stage
parameter gradient from the two rings; the W table
(:func:`weight_table`, built when the step is traced) defers each W into a
tick whose busiest device it does not lengthen, so the window's modeled
time falls below 1F1B's ``3 (M + S - 1)``. The W's a device still owes when
the loop ends run in a few ticks appended after it (W slots only, no
permutes)."""

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._zero_bubble_tick import run_window


@functools.lru_cache(maxsize=256)
def weight_table(num_stages: int, num_microbatches: int, stored: int) -> np.ndarray:
    """``(S, T)`` int: the micro-batch whose W device ``d`` runs at tick
    ``t``, or -1; ``T`` is 1F1B's ``M + 2 (S - 1)`` ticks and those appended.

    Greedy, tick by tick: a device runs its oldest pending W (its B done,
    in this tick or before) when that does not lengthen the tick (its F and
    B slots leave room under the busiest device's), in an appended tick, or
    when its slots are due: micro-batch ``m``'s residual slot is ``m + K``'s
    from that one's forward (tick ``m + K + d``), its stored cotangent's
    slot ``m + stored``'s from that one's B (tick ``m + stored + 2 (S - 1)
    - d``); the W runs in a tick before. With ``stored = K`` its modeled
    window is the integer program's optimum with one W slot a tick for
    ``S`` in 2..8, ``M`` in 1..32 (``benchmarks/pipeline_zero_bubble.py``)."""
    one = OneFOneB(num_stages, num_microbatches)
    busy, ring, lag = one.busy_table(), one.ring_size, one.lag
    mandatory = (busy % 2 == 1).astype(int) + (busy >= 2).astype(int)  # F + B
    stage = np.arange(num_stages)
    done = np.zeros(num_stages, int)  # the W's each device has run
    columns = []
    tick = 0
    while (done < num_microbatches).any():
        own = mandatory[:, tick] if tick < one.num_ticks else np.zeros_like(done)
        ready = done < np.clip(tick - 2 * lag + stage + 1, 0, num_microbatches)
        residual = (done + ring < num_microbatches) & (done + ring + stage <= tick + 1)
        cotangent = (done + stored < num_microbatches) & (
            done + stored + 2 * lag - stage <= tick + 1
        )
        due = ready & (residual | cotangent)
        longest = (own + due).max()
        runs = ready & (due | (own + 1 <= longest) | (longest == 0))
        columns.append(np.where(runs, done, -1))
        done = done + runs
        tick += 1
    table = np.stack(columns, axis=1)
    table.flags.writeable = False
    return table


@dataclasses.dataclass(frozen=True)
class ZeroBubble(OneFOneB):
    """Zero-bubble in one program: 1F1B's ticks with the backward split into
    its input part B (1F1B's backward slot) and its weight part W (a slot of
    its own, placed by :func:`weight_table`), then the ticks the W's still
    owed need. The activation memory is 1F1B's ring of ``K = min(2 S - 1,
    M)`` residual slots and a ring as long of B's boundaries (for a stage
    of ``L`` dense layers, ``L`` activations a slot: the cotangent at each
    layer's output; with remat also what B recomputed and W reads).
    ``repeats=1`` only."""

    name: ClassVar[str] = "zero-bubble"
    # The most stored boundaries a device keeps (None: the ring's K, the
    # least window); fewer cost window for memory (benchmarks/pipeline.py).
    max_stored: ClassVar[int | None] = None

    @classmethod
    def check_repeats(cls, repeats: int) -> None:
        if repeats > 1:
            raise ValueError(
                f"schedule='zero-bubble' with repeats={repeats} is not built: "
                "its W slots are placed on 1F1B's ticks, which run one stage "
                "per device. Use repeats=1 with 'zero-bubble' or '1f1b', or "
                "schedule='gpipe' for the circular schedule."
            )

    @property
    def stored_size(self) -> int:
        """The stored boundaries' slots: ``K``, or ``max_stored`` if fewer."""
        return min(self.max_stored or self.ring_size, self.ring_size)

    def weight_table(self) -> np.ndarray:
        """``(S, T)``: the micro-batch whose W each device runs at each tick,
        or -1 (:func:`weight_table`)."""
        return weight_table(self.num_stages, self.num_microbatches, self.stored_size)

    @property
    def loop_ticks(self) -> int:
        """The ticks with forward and B slots and the permutes: 1F1B's."""
        return self.num_microbatches + 2 * self.lag

    @property
    def num_ticks(self) -> int:
        """1F1B's ticks and those appended for the W's still owed."""
        return int(self.weight_table().shape[1])

    def busy_table(self) -> np.ndarray:
        """A forward, a B and a W slot, 1 each, where they carry a micro-batch
        (a bubble's slots are skipped)."""
        one = OneFOneB(self.num_stages, self.num_microbatches).busy_table()
        split = (one % 2 == 1) * 1.0 + (one >= 2) * 1.0
        split = np.pad(split, ((0, 0), (0, self.num_ticks - self.loop_ticks)))
        return split + (self.weight_table() >= 0)

    def stage_gradient_table(self) -> np.ndarray:
        """A stage's gradient at a tick is its W slot's."""
        return self.weight_table()[..., None] == np.arange(self.num_microbatches)

    def device_window(self) -> Callable[..., tuple]:
        """One device's window under ``shard_map``: the zero-bubble
        :func:`~jaxaccum._pipeline._zero_bubble_tick.run_window`."""
        return run_window
