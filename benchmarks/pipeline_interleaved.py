"""Interleaved 1F1B (``schedule="1f1b"``, ``repeats=R > 1``): its modeled
window against 1F1B's and the asynchronous ideal, and its residual ring.

Run: python benchmarks/pipeline_interleaved.py   (writes
benchmarks/results/pipeline_interleaved.json; a second, nothing compiled)
     python benchmarks/pipeline_interleaved.py --compiled   (adds its
     "compiled" key: 8 CPU devices, a few minutes)

Windows are in one device-stage's forward (1F1B's units: an interleaved
slot is 1/R of it, F = 1/R, B = 2/R), every tick as long as its busiest
device. The asynchronous interleaved ideal is 3 M + 3 (S - 1) / R; 1F1B's
window is 3 (M + S - 1). The ring is the residual slots a device keeps
(1/R of a device's stage each), against 1F1B's min(2 S - 1, M) whole ones.
--compiled measures the programs as tests/interleaved_checks.py's
checks do (with their functions, on their 128-wide model of one layer a
stage): per-device temporaries (``memory_analysis``) against 1F1B's at
S = 4, R = 2, with and without remat, for M = 2S, 4S, 8S; and the share of
the model one tick's slots run (``cost_analysis`` of the unrolled window).
Each run keeps the other's key (the compiled one names its own machine).
"""

import dataclasses
import json
import os
import pathlib
import sys

if "--compiled" in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from common import RESULTS, write_json

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum.cli.harness import machine

PATH = RESULTS / "pipeline_interleaved.json"


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


def compiled() -> dict:
    """Temporaries against 1F1B's and the slots' share of the model."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
    from interleaved_checks import interleaved_temps, slot_flops
    from pipeline_checks import wide_case, wide_temps

    stages, repeats, temps = 4, 2, {}
    for remat in (False, True):
        for num in (2 * stages, 4 * stages, 8 * stages):
            mine = interleaved_temps(remat, stages, num, repeats)
            one = wide_temps("1f1b", remat, stages, num)
            key = f"M{num}{'_remat' if remat else ''}"
            temps[key] = {"interleaved": mine, "1f1b": one, "ratio": mine / one}
            print(key, temps[key], flush=True)
    num = 8
    mine = dataclasses.replace(wide_case(stages, num, repeats), schedule="1f1b")
    one = dataclasses.replace(wide_case(stages, num), schedule="1f1b")
    shares = {
        "interleaved": slot_flops(mine, Interleaved(stages, num, repeats).num_ticks),
        "1f1b": slot_flops(one, OneFOneB(stages, num).num_ticks),
    }
    shares["ratio"] = shares["interleaved"] / shares["1f1b"]
    return {
        "machine": machine(),
        "stages": stages,
        "repeats": repeats,
        "temp_activations": temps,
        "slot_share_of_model": shares,
    }


def main() -> None:
    previous = json.loads(PATH.read_text()) if PATH.exists() else {}
    previous.pop("machine", None)
    if "--compiled" in sys.argv:
        print(write_json("pipeline_interleaved", {**previous, "compiled": compiled()}))
        return
    rows = {
        f"S{s}_R{r}_M{m}": row(s, m, r)
        for s, r, m in [
            *((4, 2, m) for m in (3, 4, 7, 8, 16, 32)),
            *((4, 4, m) for m in (4, 16)),
            *((8, 2, m) for m in (8, 32)),
        ]
    }
    print(write_json("pipeline_interleaved", {**previous, "rows": rows}))
    for name, r in rows.items():
        print(
            f"{name}: window {r['window']:.2f} vs 1F1B {r['window_1f1b']} "
            f"({r['ratio_1f1b']:.3f}), ideal {r['ideal']:.2f}, ring "
            f"{r['ring_slots']} ({r['ring_stages']:.1f} stages) vs {r['ring_1f1b']}"
        )


if __name__ == "__main__":
    main()
