"""The pipeline's schedules at the device's own slot costs (issue 74).

The modeled windows of the pipeline guide count F = 1, an unsplit backward
2 and its halves B = W = 1. On the device at hand, this times each slot as
the loop runs it, on ``gpu_model.py``'s decoder blocks: a chunk is one
block (interleaved 1F1B and the V's, ``repeats=2``), a stage two (1F1B and
zero-bubble): the forward with its residuals saved, 1F1B's backward (the
pullback whole), zero-bubble's B and W (the backward split at its jaxpr),
each also with remat for a stage (B then recomputes the forward). Each
slot: compiled alone, timed REPEATS times after warm-up, min / median / max
milliseconds.

From the medians, each schedule's window at S = 4 and M in MICROBATCHES:
the tick tables the programs run, each lockstep tick as long as its
busiest device's slots (a tick's F and backward added), summed; and
against 1F1B's. Also the windows at the unit costs, which must be each
schedule's ``modeled_window()`` (``unit_costs_match``): the tables read
right.

One device is enough: the slots are what a stage's device runs; what this
leaves out is the permutes' time and XLA's overlap of them.

Run: python benchmarks/gpu.py --pipeline [--smoke]   (on a GPU; writes
     benchmarks/results/gpu_pipeline.json; --smoke: a tiny decoder on CPU)
"""

import argparse
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from common import RESULTS, spread
from gpu_model import COMPUTE, Config, _block, init

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._1f1b_tick import backward, forward
from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum._pipeline._v_shape import VHalf, VShape
from jaxaccum._pipeline._v_tables import B, F, W
from jaxaccum._pipeline._zero_bubble import ZeroBubble
from jaxaccum._pipeline._zero_bubble_split import (
    input_part,
    split_backward,
    weight_part,
)
from jaxaccum.cli.harness import machine

STAGES, MICROBATCHES = 4, (8, 16)
SLOTS = ("forward", "backward_1f1b", "input_b", "weight_w")  # the ones timed
PRESETS = {  # (decoder, rows of a micro-batch, repeats)
    "smoke": (Config(vocab=256, d_model=64, heads=4, layers=2, seq=32, batch=8), 2, 3),
    "full": (
        Config(vocab=32768, d_model=768, heads=12, layers=2, seq=1024, batch=32),
        4,
        20,
    ),
}


def _timed(fun: Callable[..., Any], *args: Any, repeats: int) -> dict[str, float]:
    """``fun(*args)`` compiled, then timed ``repeats`` times (milliseconds)."""
    compiled = jax.jit(fun).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(1e3 * (time.perf_counter() - start))
    return spread(times)


def slot_programs(stage: Callable, given: Any, x: Any) -> tuple[dict, list, Any]:
    """Each slot's stage work as the schedules run it, ``{name: (fun,
    args)}`` to compile alone: the forward (its residuals saved), 1F1B's
    backward (the pullback whole), zero-bubble's B and W (the backward
    split at its jaxpr), and the pullback with its input's cotangent
    dropped (what W would cost without the split); with B's boundary (what
    it stores for W) and the stage's output. ``stage(given, x)`` is one
    stage; ``given`` is ``(parameters, key)``."""
    y, saved, pullback = forward(stage, given, x)
    leaves, tree = jax.tree.flatten((given, saved, y))

    def flat(*leaves):
        return jax.tree.leaves(backward(pullback, *jax.tree.unflatten(tree, leaves)))

    split = split_backward(flat, leaves, 1, 1)
    boundary = input_part(split, leaves)[1]
    programs = {
        "forward": (lambda g, x: forward(stage, g, x)[:2], (given, x)),
        "backward_1f1b": (
            lambda g, s, c: backward(pullback, g, s, c),
            (given, saved, y),
        ),
        "input_b": (lambda *a: input_part(split, a), tuple(leaves)),
        "weight_w": (lambda a, b: weight_part(split, a, b), (leaves, boundary)),
        "weight_dropped_input": (
            lambda g, s, c: backward(pullback, g, s, c)[0][0],
            (given, saved, y),
        ),
    }
    return programs, boundary, y


def slot_times(cfg: Config, rows: int, blocks: int, remat: bool, repeats: int):
    """Each slot of a stage of ``blocks`` decoder blocks on one micro-batch
    of ``rows`` sequences, as the loop runs it (milliseconds)."""
    params = jax.tree.map(lambda p: p[:blocks], init(jax.random.key(0), cfg)["blocks"])

    def stage(p, x):
        for i in range(blocks):
            x = _block(cfg, x, jax.tree.map(lambda leaf, i=i: leaf[i], p))
        return x

    body = jax.checkpoint(stage) if remat else stage
    shape = (rows, cfg.seq, cfg.d_model)
    x = jax.random.normal(jax.random.key(1), shape).astype(COMPUTE)
    programs, _, _ = slot_programs(lambda g, x: body(g[0], x), (params, None), x)
    return {
        name: _timed(fun, *args, repeats=repeats)
        for name, (fun, args) in programs.items()
        if name in SLOTS
    }


def _window(costs: np.ndarray) -> float:
    """Lockstep: each tick as long as its busiest device, summed."""
    return float(costs.max(axis=0).sum())


def windows(num: int, chunk: dict, stage: dict, stage_remat: dict) -> dict:
    """Each schedule's window at ``num`` micro-batches, the slots at the
    given costs (``{"forward", "backward_1f1b", "input_b", "weight_w"}``:
    a chunk's, a stage's, a stage's with remat)."""

    def forward_backward(busy: np.ndarray, costs: dict) -> float:
        slots = (busy % 2 == 1) * costs["forward"] + (busy >= 2) * costs[
            "backward_1f1b"
        ]
        return _window(slots)

    def split(schedule: ZeroBubble, costs: dict) -> float:
        grid = schedule.grid()
        return _window(
            (grid.forward >= 0) * costs["forward"]
            + (grid.backward >= 0) * costs["input_b"]
            + (grid.weight >= 0) * costs["weight_w"]
        )

    def v(schedule: VShape) -> float:
        op = schedule.tables().op
        names = {F: "forward", B: "input_b", W: "weight_w"}
        return _window(sum((op == k) * chunk[name] for k, name in names.items()))

    return {
        "1f1b": forward_backward(OneFOneB(STAGES, num).busy_table(), stage),
        "1f1b_remat": forward_backward(OneFOneB(STAGES, num).busy_table(), stage_remat),
        "zero-bubble": split(ZeroBubble.for_window(STAGES, num, 1, False), stage),
        "zero-bubble_remat": split(
            ZeroBubble.for_window(STAGES, num, 1, True), stage_remat
        ),
        "interleaved": forward_backward(
            Interleaved(STAGES, num, 2).busy_table(), chunk
        ),
        "v-zb": v(VShape(STAGES, num, 2)),
        "v-half": v(VHalf(STAGES, num, 2)),
    }


def unit_costs_match(num: int) -> bool:
    """At F = 1 (a stage; a chunk 1/2), a backward 2, B = W = 1, the windows
    are each schedule's ``modeled_window()`` (in a stage's forwards)."""
    stage = {"forward": 1.0, "backward_1f1b": 2.0, "input_b": 1.0, "weight_w": 1.0}
    chunk = {name: cost / 2 for name, cost in stage.items()}
    got = windows(num, chunk, stage, stage)
    zb = ZeroBubble.for_window(STAGES, num, 1, False).modeled_window()
    zb_remat = ZeroBubble.for_window(STAGES, num, 1, True).modeled_window()
    expected = {
        "1f1b": OneFOneB(STAGES, num).modeled_window(),
        "1f1b_remat": OneFOneB(STAGES, num).modeled_window(),
        "zero-bubble": zb,
        "zero-bubble_remat": zb_remat,
        "interleaved": Interleaved(STAGES, num, 2).modeled_window() / 2,
        "v-zb": VShape(STAGES, num, 2).modeled_window() / 2,
        "v-half": VHalf(STAGES, num, 2).modeled_window() / 2,
    }
    return all(abs(got[k] - expected[k]) < 1e-9 for k in expected)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny decoder on CPU")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    cfg, rows, repeats = PRESETS["smoke" if args.smoke else "full"]
    times = {
        "chunk": slot_times(cfg, rows, 1, False, repeats),
        "stage": slot_times(cfg, rows, 2, False, repeats),
        "stage_remat": slot_times(cfg, rows, 2, True, repeats),
    }
    medians = {
        kind: {name: value["median"] for name, value in slots.items()}
        for kind, slots in times.items()
    }
    rows_by_m = {}
    for num in MICROBATCHES:
        ms = windows(num, medians["chunk"], medians["stage"], medians["stage_remat"])
        rows_by_m[f"M{num}"] = {
            "window_ms": ms,
            "over_1f1b": {k: v / ms["1f1b"] for k, v in ms.items()},
            "unit_costs_match": unit_costs_match(num),
        }
    result = {
        "device": jax.devices()[0].device_kind,
        "stages": STAGES,
        "decoder": {"d_model": cfg.d_model, "heads": cfg.heads, "seq": cfg.seq},
        "rows_per_microbatch": rows,
        "repeats": repeats,
        "slot_ms": times,
        "slot_over_forward": {
            kind: {n: v / slots["forward"] for n, v in slots.items()}
            for kind, slots in medians.items()
        },
        "chunk_over_stage_forward": medians["chunk"]["forward"]
        / medians["stage"]["forward"],
        "rows": rows_by_m,
    }
    out = args.out or RESULTS / "gpu_pipeline.json"
    out.write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n")
    print(result["rows"], flush=True)
    return result


if __name__ == "__main__":
    main()
