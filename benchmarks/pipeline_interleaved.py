"""Interleaved 1F1B (``schedule="1f1b"``, ``repeats=R > 1``): its modeled
window against 1F1B's and the asynchronous ideal, and its residual ring.

Run: python benchmarks/pipeline_interleaved.py   (writes
benchmarks/results/pipeline_interleaved.json; a second, nothing compiled)

Windows are in one device-stage's forward (1F1B's units: an interleaved
slot is 1/R of it, F = 1/R, B = 2/R), every tick as long as its busiest
device. The asynchronous interleaved ideal is 3 M + 3 (S - 1) / R; 1F1B's
window is 3 (M + S - 1). The ring is the residual slots a device keeps
(1/R of a device's stage each), against 1F1B's min(2 S - 1, M) whole ones.
The compiled measurements (temporaries, FLOPs, collectives) are
tests/interleaved_checks.py's.
"""

from common import write_json

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._interleaved import Interleaved


def row(stages: int, num: int, repeats: int) -> dict:
    """One configuration's windows and rings."""
    mine = Interleaved(stages, num, repeats)
    one = OneFOneB(stages, num)
    window = mine.modeled_window() / repeats
    return {
        "stages": stages,
        "num_microbatches": num,
        "repeats": repeats,
        "ticks": mine.num_ticks,
        "window": window,
        "window_1f1b": one.modeled_window(),
        "ideal": 3 * num + 3 * (stages - 1) / repeats,
        "ratio_1f1b": window / one.modeled_window(),
        "ring_slots": mine.ring_size,
        "ring_stages": mine.ring_size / repeats,
        "ring_1f1b": one.ring_size,
    }


def main() -> None:
    rows = {
        f"S{s}_R{r}_M{m}": row(s, m, r)
        for s, r, m in [
            *((4, 2, m) for m in (3, 4, 7, 8, 16, 32)),
            *((4, 4, m) for m in (4, 16)),
            *((8, 2, m) for m in (8, 32)),
        ]
    }
    print(write_json("pipeline_interleaved", {"rows": rows}))
    for name, r in rows.items():
        print(
            f"{name}: window {r['window']:.2f} vs 1F1B {r['window_1f1b']} "
            f"({r['ratio_1f1b']:.3f}), ideal {r['ideal']:.2f}, ring "
            f"{r['ring_slots']} ({r['ring_stages']:.1f} stages) vs {r['ring_1f1b']}"
        )


if __name__ == "__main__":
    main()
