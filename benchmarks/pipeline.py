"""Pipeline parallelism read off the compiled program, on 8 CPU devices.

``jaxaccum.pipeline_value_and_grad`` on a stage x data mesh of all 8 forced
CPU devices (``--xla_force_host_platform_device_count=8``): S stages in
{2, 4, 8} (the other 8 / S devices data parallel), M micro-batches in
{S, 2S, 4S, 8S}. The model: LAYERS_PER_STAGE dense tanh layers of WIDTH per
stage (the FLOPs are the stages'), a 4-wide embedding, a 1-wide head, mean
squared error; ROWS rows per micro-batch on each data shard.

For every (S, M), from the compiled step (nothing is timed: wall-clock on
shared CPU cores is not evidence, the compiled program is exact):

* FLOPs (``cost_analysis``, the tick loop unrolled: XLA counts a loop's
  body once) of the window over all devices, against the sequential model's
  on one device with the same global batch, and the bubble formula
  ``(M R + S - 1) / (M R)``; and against MaxText's nesting (A accumulation
  steps, each a pipeline of M / A micro-batches: A times one such step's
  FLOPs), for A = 2;
* the collectives inside the loop and outside it (count and bytes), and the
  bytes one window moves per device (outside once, the loop's once per tick);
* memory per device (``memory_analysis``): arguments (1/S of the stage
  parameters), temporaries without and with ``remat``, in units of one
  micro-batch's activation;
* the same for ``schedule="1f1b"``: its FLOPs (counted statically: a
  bubble slot's ``lax.cond`` at its larger branch, so against ``(M + 2 (S -
  1)) / M``), its loop's collectives and its temporaries.

From those rows, the trade: at each activation budget (GPipe with remat's
temporaries at M = S, 2S, 4S), the largest M of the sweep each schedule fits
and the bubble ``(S - 1) / (M + S - 1)`` it reaches there.

And one timing, the only one here (a design choice, not a claim about a
device): 1F1B's bubble slots skipped (``lax.cond``, the default) against
computed on masked inputs and selected away, beside GPipe, at S = 4 x data =
2, interleaved rounds, min / median / max milliseconds per window.

And ``schedule="zero-bubble"`` at S = 4 x data = 2, M = S, 2S, 4S, 8S (its
``zero_bubble`` key): its modeled window against 1F1B's and the asynchronous
ZB-H1's, its rings and inboxes, its loop's collectives and permutes, its
FLOPs against 1F1B's, its temporaries with and without remat (beside the
rows' 1F1B ones), each slot's FLOPs against a forward's, and the windows
with each slot at its measured cost.

Run: ``python benchmarks/pipeline.py``; writes ``benchmarks/results/pipeline.json``
and prints a table. ``python benchmarks/pipeline.py --zero-bubble`` measures
the zero-bubble key alone (a few minutes) and replaces it in that file.
"""

import json
import os
import sys
import time

# Before JAX starts its CPU backend (on first use, not at import).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import RESULTS, spread, write_json  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from pipeline_slots import slot_programs  # noqa: E402

import jaxaccum  # noqa: E402
import jaxaccum.testing  # noqa: E402
from jaxaccum._pipeline._1f1b import OneFOneB  # noqa: E402
from jaxaccum._pipeline._spec import PipelineLayout, PipelineWindow  # noqa: E402
from jaxaccum._pipeline._step import make_pipeline  # noqa: E402
from jaxaccum._pipeline._zero_bubble import ZeroBubble  # noqa: E402
from jaxaccum.cli.harness import machine  # noqa: E402

NUM_DEVICES = 8
STAGES = (2, 4, 8)
MICROBATCH_FACTORS = (1, 2, 4, 8)  # M = factor * S
WIDTH, INPUTS, LAYERS_PER_STAGE, ROWS = 256, 4, 2, 64
NESTED_STEPS = 2
TIMED_STAGES, TIMED_MICROBATCHES, ROUNDS, CALLS_PER_ROUND = 4, (4, 16), 9, 5


def embed_fn(params, micro_batch):
    return micro_batch["x"] @ params["w"]


def stage_fn(params, x):
    for layer in range(LAYERS_PER_STAGE):
        x = jnp.tanh(x @ params["w"][layer] + params["b"][layer])
    return x


def loss_fn(params, x, micro_batch):
    return jnp.mean((x @ params["w"] - micro_batch["y"]) ** 2)


def sequential_loss(params, batch):
    embed, stages, head = params
    x = embed_fn(embed, batch)
    for stage in range(stages["w"].shape[0]):
        x = stage_fn(jax.tree.map(lambda p, i=stage: p[i], stages), x)
    return loss_fn(head, x, batch)


def model(num_stages: int, rows: int):
    keys = jax.random.split(jax.random.key(0), 5)
    shape = (num_stages, LAYERS_PER_STAGE)
    params = (
        {"w": jax.random.normal(keys[0], (INPUTS, WIDTH)) / INPUTS**0.5},
        {
            "w": jax.random.orthogonal(keys[1], WIDTH, shape),
            "b": jnp.zeros((*shape, WIDTH)),
        },
        {"w": jax.random.normal(keys[2], (WIDTH, 1)) / WIDTH**0.5},
    )
    batch = {
        "x": jax.random.normal(keys[3], (rows, INPUTS)),
        "y": jax.random.normal(keys[4], (rows, 1)),
    }
    return params, batch


def placed(mesh, params, batch):
    replicated, staged = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
    params = jax.device_put(params, (replicated, staged, replicated))
    return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


def compile_step(mesh, num, params, batch, **options):
    step = jaxaccum.pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        num,
        mesh=mesh,
        embed_fn=embed_fn,
        data_axis="data",
        **options,
    )
    return jax.jit(step).lower(*placed(mesh, params, batch)).compile()


def flops(compiled) -> float:
    return compiled.cost_analysis()["flops"] * NUM_DEVICES


def collectives(compiled) -> dict:
    counts = jaxaccum.testing.count_collectives(compiled)
    moved = jaxaccum.testing.collective_bytes(compiled)
    return {
        op: {"count": counts[op], "bytes": moved[op]}
        for op in counts
        if counts[op]["loop"] or counts[op]["outside"]
    }


def measure(num_stages: int, num: int) -> dict:
    """One (S, M): FLOPs, collectives, bytes and memory per device."""
    shards = NUM_DEVICES // num_stages
    mesh = jax.make_mesh((num_stages, shards), ("stage", "data"))
    rows = ROWS * num * shards
    params, batch = model(num_stages, rows)
    sequential = jax.jit(jax.value_and_grad(sequential_loss)).lower(params, batch)
    sequential_flops = sequential.compile().cost_analysis()["flops"]
    unrolled = compile_step(mesh, num, params, batch, unroll=True)
    rolled = compile_step(mesh, num, params, batch)
    remat = compile_step(mesh, num, params, batch, remat=True)
    ticks = num + num_stages - 1
    row = {
        "stages": num_stages,
        "data_shards": shards,
        "num_microbatches": num,
        "ticks": ticks,
        "bubble_fraction": (num_stages - 1) / ticks,
        "flops_ratio": flops(unrolled) / sequential_flops,
        "formula": ticks / num,
    }
    row["flops_excess"] = row["flops_ratio"] / row["formula"] - 1
    if num % NESTED_STEPS == 0:
        nested_params, nested_batch = model(num_stages, rows // NESTED_STEPS)
        nested = compile_step(
            mesh, num // NESTED_STEPS, nested_params, nested_batch, unroll=True
        )
        row["nested_flops_ratio"] = NESTED_STEPS * flops(nested) / sequential_flops
        row["nested_formula"] = (num + NESTED_STEPS * (num_stages - 1)) / num
    row["collectives"] = collectives(rolled)
    row["window_bytes"] = jaxaccum.testing.window_bytes(rolled, ticks)
    memory, remat_memory = rolled.memory_analysis(), remat.memory_analysis()
    activation = ROWS * WIDTH * 4
    stage_bytes = sum(p.nbytes for p in jax.tree.leaves(params[1]))
    row["memory"] = {
        "activation_bytes": activation,
        "argument_bytes": memory.argument_size_in_bytes,
        "stage_param_bytes_model": stage_bytes,
        "stage_param_bytes_device": stage_bytes // num_stages,
        "temp_bytes": memory.temp_size_in_bytes,
        "temp_bytes_remat": remat_memory.temp_size_in_bytes,
        "temp_activations": memory.temp_size_in_bytes / activation,
        "temp_activations_remat": remat_memory.temp_size_in_bytes / activation,
    }
    row["one_f_one_b"] = one_f_one_b(mesh, num, params, batch, sequential_flops)
    return row


def one_f_one_b(mesh, num, params, batch, sequential_flops) -> dict:
    """``schedule="1f1b"`` at one (S, M): FLOPs, loop collectives, memory."""
    num_stages = mesh.shape["stage"]
    unrolled = compile_step(mesh, num, params, batch, unroll=True, schedule="1f1b")
    rolled = compile_step(mesh, num, params, batch, schedule="1f1b")
    remat = compile_step(mesh, num, params, batch, remat=True, schedule="1f1b")
    ticks = num + 2 * (num_stages - 1)
    activation = ROWS * WIDTH * 4
    return {
        "ticks": ticks,
        "ring_slots": min(2 * num_stages - 1, num),
        "flops_ratio": flops(unrolled) / sequential_flops,
        "formula_static": ticks / num,
        "collectives": collectives(rolled),
        "temp_activations": rolled.memory_analysis().temp_size_in_bytes / activation,
        "temp_activations_remat": (
            remat.memory_analysis().temp_size_in_bytes / activation
        ),
    }


SCHEDULES = {  # name: (where in a row its temporaries are, remat key)
    "gpipe": ("memory", "temp_activations"),
    "gpipe_remat": ("memory", "temp_activations_remat"),
    "1f1b": ("one_f_one_b", "temp_activations"),
    "1f1b_remat": ("one_f_one_b", "temp_activations_remat"),
}


def trade(rows: list[dict]) -> dict:
    """Per S and activation budget (GPipe with remat's temporaries at M = S,
    2S, 4S): per schedule the largest M of the sweep whose temporaries fit,
    and its bubble; None where none fits."""
    result = {}
    for num_stages in STAGES:
        own = [r for r in rows if r["stages"] == num_stages]
        for budget_row in own[:-1]:
            budget = budget_row["memory"]["temp_activations_remat"]
            entry = {"budget_activations": budget}
            for name, (part, key) in SCHEDULES.items():
                fits = [r["num_microbatches"] for r in own if r[part][key] <= budget]
                largest = max(fits, default=None)
                entry[name] = {
                    "num_microbatches": largest,
                    "bubble": None
                    if largest is None
                    else (num_stages - 1) / (largest + num_stages - 1),
                    "largest_of_sweep": largest == own[-1]["num_microbatches"],
                }
            name = f"S{num_stages}_budget_M{budget_row['num_microbatches']}"
            result[name] = entry
    return result


def timed_step(num: int, schedule: str, skip: bool = True):
    """The S = 4 x data = 2 step, jitted and placed, with its arguments."""
    num_stages = TIMED_STAGES
    shards = NUM_DEVICES // num_stages
    mesh = jax.make_mesh((num_stages, shards), ("stage", "data"))
    params, batch = model(num_stages, ROWS * num * shards)
    layout = PipelineLayout(data_axis="data", schedule=schedule)
    options = PipelineWindow(num, layout=layout)
    step = make_pipeline((stage_fn, loss_fn, embed_fn), options, mesh, 0.0, skip)
    args = placed(mesh, params, batch)
    compiled = jax.jit(step).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return compiled, args


def bubble_timing() -> dict:
    """Milliseconds per window, interleaved rounds: 1F1B with its bubble
    slots skipped and computed, and GPipe, per M."""
    result = {}
    for num in TIMED_MICROBATCHES:
        configs = {
            "gpipe": timed_step(num, "gpipe"),
            "1f1b_skipped": timed_step(num, "1f1b", skip=True),
            "1f1b_masked": timed_step(num, "1f1b", skip=False),
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(ROUNDS):
            for name, (compiled, args) in configs.items():
                start = time.perf_counter()
                for _ in range(CALLS_PER_ROUND):
                    out = compiled(*args)
                jax.block_until_ready(out)
                elapsed = (time.perf_counter() - start) / CALLS_PER_ROUND
                times[name].append(1e3 * elapsed)
        entry = {f"{name}_ms": spread(t) for name, t in times.items()}
        masked, skipped = times["1f1b_masked"], times["1f1b_skipped"]
        entry["skipped_over_masked"] = spread(
            [s / m for s, m in zip(skipped, masked, strict=True)]
        )
        entry["1f1b_skipped_over_gpipe"] = spread(
            [s / g for s, g in zip(skipped, times["gpipe"], strict=True)]
        )
        result[f"M{num}"] = entry
    return result


def by_name(rows: list[dict]) -> dict:
    """The rows keyed ``S4_M16``: the guide names a figure by its path."""
    return {f"S{r['stages']}_M{r['num_microbatches']}": r for r in rows}


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'S':>2} {'D':>2} {'M':>3} {'FLOPs/seq':>10} {'formula':>8} "
        f"{'nested A=2':>10} {'loop ops':>22} {'window KiB':>10} "
        f"{'temp act':>9} {'remat act':>9}"
    )
    for row in rows:
        loop = ", ".join(
            f"{op} x{c['count']['loop']}"
            for op, c in row["collectives"].items()
            if c["count"]["loop"]
        )
        memory = row["memory"]
        print(
            f"{row['stages']:>2} {row['data_shards']:>2} "
            f"{row['num_microbatches']:>3} {row['flops_ratio']:>10.4f} "
            f"{row['formula']:>8.4f} {row.get('nested_flops_ratio', 0):>10.4f} "
            f"{loop:>22} {row['window_bytes'] / 1024:>10.1f} "
            f"{memory['temp_activations']:>9.1f} "
            f"{memory['temp_activations_remat']:>9.1f}"
        )


def print_trade(trade: dict, timing: dict) -> None:
    print(f"{'budget':>16} {'act':>6} " + " ".join(f"{n:>16}" for n in SCHEDULES))
    for name, entry in trade.items():
        cells = [
            "-"
            if entry[n]["num_microbatches"] is None
            else f"M={entry[n]['num_microbatches']} b={entry[n]['bubble']:.3f}"
            for n in SCHEDULES
        ]
        print(
            f"{name:>16} {entry['budget_activations']:>6.1f} "
            + " ".join(f"{c:>16}" for c in cells)
        )
    for name, entry in timing.items():
        print(
            name,
            ", ".join(
                f"{k}: {v['min']:.3f} / {v['median']:.3f} / {v['max']:.3f}"
                for k, v in entry.items()
            ),
        )


ZERO_BUBBLE_STAGES = 4
ZERO_BUBBLE_MICROBATCHES = (4, 8, 16, 32)  # S, 2S, 4S, 8S


def zero_bubble_slot_flops(remat: bool) -> dict:
    """Each slot's FLOPs (``cost_analysis``) against the forward's, one
    stage of this model on one micro-batch, compiled alone as the slots run
    it: the forward (its residuals saved), 1F1B's backward (the pullback
    whole), zero-bubble's B and W (the backward split at its jaxpr), the
    pullback with its input's cotangent dropped (W without the split), and
    the boundary B stores for W, in activations."""
    params, batch = model(1, ROWS)
    stage = jax.tree.map(lambda p: p[0], params[1])
    body = jax.checkpoint(stage_fn) if remat else stage_fn
    x = embed_fn(params[0], batch)
    given = (stage, None)
    programs, boundary, y = slot_programs(lambda g, x: body(g[0], x), given, x)

    def cost(fun, *args):
        return jax.jit(fun).lower(*args).compile().cost_analysis()["flops"]

    flops_of = {name: cost(fun, *args) for name, (fun, args) in programs.items()}
    ratios = {name: value / flops_of["forward"] for name, value in flops_of.items()}
    return {**ratios, "boundary_activations": sum(b.size for b in boundary) / y.size}


def zero_bubble_row(num: int) -> dict:
    """``schedule="zero-bubble"`` at S = 4 x data = 2 and ``num``: the
    modeled windows, the grid's rings and inboxes, the loop's collectives
    and permutes a window (the lockstep's overhead: a tick a slot, both
    permutes each), FLOPs against 1F1B's and temporaries (with and without
    remat)."""
    num_stages = ZERO_BUBBLE_STAGES
    mesh = jax.make_mesh((num_stages, NUM_DEVICES // num_stages), ("stage", "data"))
    params, batch = model(num_stages, ROWS * num * (NUM_DEVICES // num_stages))
    schedule, one = ZeroBubble(num_stages, num), OneFOneB(num_stages, num)
    grid = schedule.grid()
    activation = ROWS * WIDTH * 4
    compiled = {
        remat: compile_step(
            mesh, num, params, batch, remat=remat, schedule="zero-bubble"
        )
        for remat in (False, True)
    }
    unrolled = {
        kind: compile_step(mesh, num, params, batch, unroll=True, schedule=kind)
        for kind in ("zero-bubble", "1f1b")
    }
    window, one_window = schedule.modeled_window(), one.modeled_window()
    w_only = schedule.num_ticks - schedule.loop_ticks
    remat = ZeroBubble.for_window(num_stages, num, 1, True)
    return {
        "remat_modeled_window": remat.modeled_window(),
        "remat_ratio_to_1f1b": remat.modeled_window() / one_window,
        "remat_stored_slots": remat.stored_size,
        "remat_w_only_ticks": remat.num_ticks - remat.loop_ticks,
        "ring_slots": schedule.ring_size,
        "stored_slots": schedule.stored_size,
        "inbox_slots": grid.inbox_size + grid.back_size,
        "loop_ticks": schedule.loop_ticks,
        "w_only_ticks": w_only,
        "permutes": 2 * schedule.loop_ticks,
        "one_f_one_b_permutes": 2 * one.num_ticks,
        "modeled_window": window,
        "one_f_one_b_window": one_window,
        "async_zb_h1_window": 3.0 * num + num_stages - 1,
        "ratio_to_1f1b": window / one_window,
        "async_ratio_to_1f1b": (3.0 * num + num_stages - 1) / one_window,
        "flops_over_1f1b": flops(unrolled["zero-bubble"]) / flops(unrolled["1f1b"]),
        "flops_formula": (3 * schedule.loop_ticks + w_only) / (3 * one.num_ticks),
        "collectives": collectives(compiled[False]),
        "temp_activations": compiled[False].memory_analysis().temp_size_in_bytes
        / activation,
        "temp_activations_remat": compiled[True].memory_analysis().temp_size_in_bytes
        / activation,
    }


def window_at_costs(num: int, costs: dict, remat: bool) -> dict:
    """The modeled windows of 1F1B and zero-bubble at S = 4 with each slot
    at its measured cost (``costs``: :func:`zero_bubble_slot_flops`) instead
    of F = 1, B = 2 unsplit, B = W = 1 split; zero-bubble on the tables it
    runs with ``remat`` and on the other's."""
    one = OneFOneB(ZERO_BUBBLE_STAGES, num)
    busy = one.busy_table()
    forward_slots, backward_slots = busy % 2 == 1, busy >= 2
    other = ZeroBubble.for_window(ZERO_BUBBLE_STAGES, num, 1, not remat).grid()
    grid = ZeroBubble.for_window(ZERO_BUBBLE_STAGES, num, 1, remat).grid()

    def window(grid) -> float:
        split = (
            (grid.forward >= 0) * costs["forward"]
            + (grid.backward >= 0) * costs["input_b"]
            + (grid.weight >= 0) * costs["weight_w"]
        )
        return float(split.max(axis=0).sum())

    unsplit = forward_slots * costs["forward"] + backward_slots * costs["backward_1f1b"]
    windows = {
        "one_f_one_b": float(unsplit.max(axis=0).sum()),
        "zero_bubble": window(grid),
        "other_tables": window(other),
    }
    return {
        **windows,
        "ratio": windows["zero_bubble"] / windows["one_f_one_b"],
        "other_ratio": windows["other_tables"] / windows["one_f_one_b"],
    }


def zero_bubble_section() -> dict:
    """Zero-bubble's figures: per M its row and the slots' FLOPs."""
    rows = {f"M{num}": zero_bubble_row(num) for num in ZERO_BUBBLE_MICROBATCHES}
    slots = {
        "plain": zero_bubble_slot_flops(False),
        "remat": zero_bubble_slot_flops(True),
    }
    return {
        "stages": ZERO_BUBBLE_STAGES,
        "data_shards": NUM_DEVICES // ZERO_BUBBLE_STAGES,
        "rows": rows,
        "slot_flops": slots,
        "window_at_measured_costs": {
            f"M{num}_{kind}": window_at_costs(num, costs, kind == "remat")
            for num in ZERO_BUBBLE_MICROBATCHES
            for kind, costs in slots.items()
        },
    }


def write_zero_bubble() -> None:
    """Runs :func:`zero_bubble_section` alone: its key in pipeline.json
    replaced, the other figures left as they were measured."""
    path = RESULTS / "pipeline.json"
    results = json.loads(path.read_text())
    results["zero_bubble"] = {"machine": machine(), **zero_bubble_section()}
    path.write_text(json.dumps(results, indent=2) + "\n")
    for name, row in results["zero_bubble"]["rows"].items():
        print(name, {k: v for k, v in row.items() if k != "collectives"})


def main() -> None:
    assert jax.device_count() == NUM_DEVICES, (
        f"{jax.device_count()} devices: XLA_FLAGS was applied too late"
    )
    if "--zero-bubble" in sys.argv:
        write_zero_bubble()
        return
    timing = bubble_timing()  # first, on a quiet machine
    rows = [
        measure(num_stages, factor * num_stages)
        for num_stages in STAGES
        for factor in MICROBATCH_FACTORS
    ]
    write_json(
        "pipeline",
        {
            "devices": NUM_DEVICES,
            "model": {
                "width": WIDTH,
                "inputs": INPUTS,
                "layers_per_stage": LAYERS_PER_STAGE,
                "rows_per_microbatch_per_shard": ROWS,
            },
            "nested_steps": NESTED_STEPS,
            "rows": by_name(rows),
            "trade": trade(rows),
            "zero_bubble": zero_bubble_section(),
            "bubble_timing": {
                "stages": TIMED_STAGES,
                "data_shards": NUM_DEVICES // TIMED_STAGES,
                "rounds": ROUNDS,
                "calls_per_round": CALLS_PER_ROUND,
                **timing,
            },
        },
    )
    print_rows(rows)
    print_trade(trade(rows), timing)


if __name__ == "__main__":
    main()
