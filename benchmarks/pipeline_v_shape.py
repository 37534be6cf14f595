"""V-shaped schedules in lockstep, modeled (issue 74, items 3 and 4): how
long a window a device cap on activations held buys, before any program is
built.

Run: python benchmarks/pipeline_v_shape.py   (writes
benchmarks/results/pipeline_v_shape.json; a few seconds)

Qi et al. ("Pipeline Parallelism with Controllable Memory", NeurIPS 2024)
give each of ``S`` devices two of ``2 S`` chunks: device ``d`` holds chunk
``d`` and chunk ``2 S - 1 - d``, so a micro-batch goes down the devices and
back up, and its loss is taken on device 0. Each chunk's backward is split
into B (the input's cotangent) and W (the weights' gradient), as in
zero-bubble. The schedule is modeled on the tables the program runs
(``jaxaccum._pipeline._v_tables.greedy``, ``schedule="v-zb"``'s): in
ticks, each device running one chunk's F, B or W per tick (F = B = W, no
remat), an activation or cotangent sent in one tick usable in the next (a
collective-permute, or a device handing itself the turn at the V's tip).
Each device picks greedily, tick by tick: its oldest pending W when it
holds ``cap`` chunk activations (from their F to their W; ``cap`` the
family's one knob); else a B whose cotangent has arrived (the oldest
micro-batch, the later chunk first); else an F whose input has arrived
and which leaves room under ``cap`` (the up chunk's first, and a new
micro-batch only with a slot to spare for its up chunk); else a W.

Reported per (S, M) and cap, in stage units (a chunk's op is half a
stage's): the modeled window against the landed lockstep 1F1B's
``3 (M + S - 1)`` and the asynchronous ZB-H1's ``3 M + S - 1``, and the most
activations a device holds (chunk activations / 2, in micro-batches of a
whole stage) against 1F1B's ring of ``min(2 S - 1, M)`` and the
asynchronous 1F1B's ``min(S, M)``. The caps named: V-ZB at ``2 S`` (the
asynchronous 1F1B's memory), V-Half at ``S`` and V-Min at ``ceil(2 S / 3)``,
and the least cap whose window is no longer than 1F1B's.

``remat``: the windows if B recomputed its chunk's forward (B = 2 F, W = F,
a lockstep tick as long as its longest op) on the programs' own tables
(``schedule="v-zb"``'s and ``"v-half"``'s), against lockstep 1F1B's with
remat (a tick's backward 3 F: the forward recomputed, then the backward).
"""

import math

import numpy as np
from common import write_json

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._v_tables import greedy, half_plan, v_tables


def v_schedule(stages: int, num: int, cap: int) -> dict:
    """The greedy V-shaped schedule's modeled window (chunk ticks) and the
    most chunk activations a device holds at once (F's run less W's run, at
    the end of a tick): the tables ``schedule="v-zb"`` runs
    (``_v_tables.greedy``) at ``cap``."""
    op = greedy(stages, num, cap)[0]  # per device and tick: -1, 0 F, 1 B, 2 W
    held = np.cumsum(op == 0, axis=1) - np.cumsum(op == 2, axis=1)
    return {"chunk_ticks": int(op.shape[1]), "held_chunks": int(held.max())}


def _row(stages: int, num: int) -> dict:
    one = OneFOneB(stages, num)
    reference = {
        "one_f_one_b_window": one.modeled_window(),
        "async_zb_h1_window": 3.0 * num + stages - 1,
        "one_f_one_b_ring": one.ring_size,
        "async_one_f_one_b_held": min(stages, num),
    }
    caps = {}
    for cap in range(3, 4 * stages + 1):
        run = v_schedule(stages, num, cap)
        caps[cap] = {
            "window": run["chunk_ticks"] / 2,
            "held": run["held_chunks"] / 2,
            "ratio_to_1f1b": run["chunk_ticks"] / 2 / reference["one_f_one_b_window"],
        }
    named = {"v_zb": 2 * stages, "v_half": stages, "v_min": math.ceil(2 * stages / 3)}
    named = {name: max(cap, 3) for name, cap in named.items()}
    fits = [c for c, v in caps.items() if v["ratio_to_1f1b"] <= 1.0]
    named["least_within_1f1b"] = min(fits)
    return {
        **reference,
        "remat": _remat_windows(stages, num),
        "caps": caps,
        "named": {name: {"cap": cap, **caps[cap]} for name, cap in named.items()},
    }


def _remat_windows(stages: int, num: int) -> dict:
    """Stage-forward units with remat: each lockstep tick as long as its
    longest op (the V: F 1/2, B 1, W 1/2 of a stage's forward; 1F1B: F 1,
    B 3)."""
    busy = OneFOneB(stages, num).busy_table()  # 1 F, 2 B, 3 both
    one = np.choose(busy.astype(int), [0, 1, 3, 4]).max(axis=0).sum()
    windows = {"one_f_one_b": float(one)}
    for name, plan in (("v_zb", ()), ("v_half", half_plan(stages, num))):
        op = v_tables(stages, num, *plan).op  # -1 idle, 0 F, 1 B, 2 W
        cost = np.choose(op + 1, [0.0, 0.5, 1.0, 0.5]).max(axis=0).sum()
        windows[name] = float(cost)
        windows[f"{name}_over_1f1b"] = float(cost / one)
    return windows


def main() -> None:
    rows = {}
    for stages in (2, 4, 8):
        for num in (stages, 2 * stages, 4 * stages, 8 * stages):
            rows[f"S{stages}_M{num}"] = row = _row(stages, num)
            named = row["named"]
            print(
                f"S={stages} M={num:>2}: 1F1B {row['one_f_one_b_window']:5.1f} "
                f"(ring {row['one_f_one_b_ring']}), ZB-H1 "
                f"{row['async_zb_h1_window']:5.1f}; "
                + "; ".join(
                    f"{name} cap {v['cap']}: {v['window']:5.1f} "
                    f"({v['ratio_to_1f1b']:.2f}x), held {v['held']:.1f}"
                    for name, v in named.items()
                )
            )
    write_json("pipeline_v_shape", {"rows": rows})


if __name__ == "__main__":
    main()
