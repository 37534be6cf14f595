"""Zero-bubble in one lockstep program with F and B at 1F1B's ticks: the
least modeled window any placement of the W slots reaches (the tables the
schedule runs with remat; without remat it runs ZB-H1's grid, below this
bound at M = S: ``jaxaccum._pipeline._zero_bubble``; issue 57).

Run: python benchmarks/pipeline_zero_bubble.py   (writes
benchmarks/results/pipeline_zero_bubble.json; a few seconds)

The landed 1F1B gives each device a forward slot and a backward slot per
tick, in lockstep: a tick lasts as long as its busiest device (F = 1, an
unsplit backward B = 2), so its window is 3 (M + S - 1), the asynchronous
1F1B's. Zero-bubble (Qi et al., ICLR 2024) splits the backward into its input
part (1, on the critical path: the cotangent the stage before waits for) and
its weight part W (1, needed only when the window ends). Keeping 1F1B's
forward and input-backward slots (the same ticks, the same permutes), the
question is where each device's W slots go: a W of micro-batch m on device d
may run in the tick of its input-backward or any later one, or in ticks
appended after the loop. This script finds the placement with the least
modeled window exactly (an integer program: per tick the busiest device's F,
B and W count; scipy's HiGHS), and reports, per (S, M):

- its modeled window against 1F1B's and the asynchronous ZB-H1's
  3M + (S - 1);
- the W slots a tick needs at most (each a per-device ``lax.cond`` slot in
  the program) and the ticks appended;
- how long residuals live: a device keeps a micro-batch's stage residuals
  from its forward to its W (1F1B: to its backward), the most it holds at
  once against 1F1B's ring of min(2S - 1, M).
"""

import numpy as np
from common import write_json
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxaccum._pipeline._1f1b import OneFOneB


def _slots(stages: int, num: int) -> tuple[np.ndarray, np.ndarray]:
    """1F1B's forward and (input-)backward slots, ``(S, T)`` 0/1 each."""
    schedule = OneFOneB(stages, num)
    busy = schedule.busy_table()  # forward 1 + backward 2
    backward = (busy >= 2).astype(float)
    return busy - 2 * backward, backward


def placement(stages: int, num: int, slots: int | None = None) -> dict:
    """The W placement with the least modeled window (at most ``slots`` W
    slots a tick, if given), each W as early as that allows (the residuals
    freed soonest), and its figures."""
    forward, backward = _slots(stages, num)
    ticks = forward.shape[1] + num  # room to append up to M ticks of W
    pad = ((0, 0), (0, num))
    forward, backward = np.pad(forward, pad), np.pad(backward, pad)
    mandatory = forward + backward
    # Variables: w[d, t] (W slots of device d at tick t), then c[t].
    n_w, n = stages * ticks, stages * ticks + ticks
    # A W's lateness costs less than one unit of window in total.
    lateness = np.tile(np.arange(ticks), stages) / (stages * num * ticks + 1.0)
    cost = np.concatenate([lateness, np.ones(ticks)])
    rows, low, high = [], [], []
    for d in range(stages):
        for t in range(ticks):
            row = np.zeros(n)  # mandatory + w <= c
            row[d * ticks + t], row[n_w + t] = 1, -1
            rows.append(row), low.append(-np.inf), high.append(-mandatory[d, t])
            row = np.zeros(n)  # W's so far <= input-backwards so far
            row[d * ticks : d * ticks + t + 1] = 1
            rows.append(row), low.append(-np.inf)
            high.append(backward[d, : t + 1].sum())
        row = np.zeros(n)  # every W once
        row[d * ticks : (d + 1) * ticks] = 1
        rows.append(row), low.append(num), high.append(num)
    result = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), low, high),
        integrality=np.ones(n),
        bounds=Bounds(
            0, np.concatenate([np.full(n_w, slots or np.inf), np.full(ticks, np.inf)])
        ),
    )
    assert result.success, result.message
    w = np.rint(result.x[:n_w]).reshape(stages, ticks)
    per_tick = np.rint(result.x[n_w:])
    return _figures(stages, num, forward, backward, w, per_tick)


def _row(stages: int, num: int) -> dict:
    """The best placement, and the best with one W slot a tick."""
    best = placement(stages, num)
    one = placement(stages, num, slots=1)
    return {**best, "one_slot": {k: one[k] for k in _ONE_SLOT}}


_ONE_SLOT = ("zero_bubble_window", "ratio_to_1f1b", "appended_ticks", "residuals_held")


def _figures(stages, num, forward, backward, w, per_tick) -> dict:
    used = np.flatnonzero(per_tick > 0)
    appended = max(0, int(used.max()) + 1 - OneFOneB(stages, num).num_ticks)
    one_f_one_b = OneFOneB(stages, num).modeled_window()
    window = float(per_tick.sum())
    return {
        "stages": stages,
        "num_microbatches": num,
        "zero_bubble_window": window,
        "one_f_one_b_window": one_f_one_b,
        "async_zb_h1_window": 3.0 * num + stages - 1,
        "ratio_to_1f1b": window / one_f_one_b,
        "async_ratio_to_1f1b": (3.0 * num + stages - 1) / one_f_one_b,
        "max_w_slots_per_tick": int(w.max()),
        "appended_ticks": appended,
        "residuals_held": _held(forward, backward, w),
        "one_f_one_b_ring": OneFOneB(stages, num).ring_size,
    }


def _held(forward: np.ndarray, backward: np.ndarray, w: np.ndarray) -> int:
    """The most micro-batches whose residuals a device holds at once: from
    a forward to the W that consumes them (the W's taken oldest first)."""
    most = 0
    for d in range(forward.shape[0]):
        entered = np.cumsum(forward[d])
        left = np.cumsum(w[d])  # W's run in micro-batch order, after the B's
        most = max(most, int((entered - np.concatenate([[0], left[:-1]])).max()))
    return most


def main() -> None:
    rows = {}
    for stages in (2, 4, 8):
        for num in sorted({1, stages - 1, stages, 2 * stages - 1, 4, 16, 4 * stages}):
            if num >= 1:
                rows[f"S{stages}_M{num}"] = _row(stages, num)
    for name, row in rows.items():
        print(
            f"{name:>8}: ZB {row['zero_bubble_window']:5.0f} / 1F1B "
            f"{row['one_f_one_b_window']:5.0f} = {row['ratio_to_1f1b']:.3f} "
            f"(async {row['async_ratio_to_1f1b']:.3f}); W slots/tick "
            f"{row['max_w_slots_per_tick']}, appended {row['appended_ticks']}, "
            f"held {row['residuals_held']} vs ring {row['one_f_one_b_ring']}; one W "
            f"slot: {row['one_slot']['ratio_to_1f1b']:.3f}, held "
            f"{row['one_slot']['residuals_held']}"
        )
    write_json("pipeline_zero_bubble", {"rows": rows})


if __name__ == "__main__":
    main()
