"""The pipeline's planner against the best fixed window, on 8 CPU devices.

``jaxaccum.plan_pipeline`` chooses the window ``M``, the schedule (GPipe,
1F1B or zero-bubble with ``repeats=1``; the circular GPipe or interleaved
1F1B with ``repeats > 1``) and ``remat`` for a memory budget, the
micro-batch held fixed. The simple alternative it replaces is one fixed
``(schedule, M, remat)`` for every budget; the best such setting
is chosen here in hindsight, per task, as the one with the highest mean
efficiency over the budgets (a setting that does not fit a budget scores 0
there: it runs out of memory). Neither task, nor their budgets, was used to
design the planner (the planner's only setting, its candidates ``S 2**k``,
is the default of both).

Tasks: ``jaxaccum.cli.models.pipelined_mlp_task`` (residual ReLU blocks of
512, 784 inputs, cross-entropy) on stage=4 x data=2, 64 rows per micro-batch
per shard; and a 2-layer tanh MLP stage of 256 (``benchmarks/pipeline.py``'s
model) on stage=8, ``repeats=2``, 128 rows per micro-batch.

For every task, every ``(schedule, M, remat)`` is compiled once (its footprint per
device, ``memory_analysis()``, and its efficiency, the share of the window's
stage work that is useful); at each of 7 budgets spaced geometrically over
the footprints the planner's choice is compared with the exhaustive best
(the most efficient that fits), with the best fixed setting, and with the
exhaustive best of GPipe alone (what choosing the schedule adds). The
efficiency's remat term is checked against the compiled FLOPs: what remat
adds to the window's loop body (counted once) against one stage's forward.

Run: ``python benchmarks/pipeline_plan.py``; writes
``benchmarks/results/pipeline_plan.json`` and prints a table.
"""

import itertools
import os

# Before JAX starts its CPU backend (on first use, not at import).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import write_json  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from pipeline import embed_fn, loss_fn, model, stage_fn  # noqa: E402

import jaxaccum  # noqa: E402
from jaxaccum._pipeline._schedules import SCHEDULES as REGISTERED  # noqa: E402
from jaxaccum._pipeline._schedules import builds  # noqa: E402
from jaxaccum.cli import models  # noqa: E402

NUM_BUDGETS = 7


def mlp_task():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    task = models.pipelined_mlp_task(784, 512, 4)
    params = staged(mesh, task.params)
    micro = jax.eval_shape(lambda: task.make_batch(jax.random.key(0), 64 * 2))
    functions = (task.stage_fn, task.loss_fn, task.embed_fn)
    return (
        "mlp_stage4_data2",
        mesh,
        functions,
        params,
        micro,
        {"data_axis": "data"},
    )


def tanh_task():
    mesh = jax.make_mesh((8,), ("stage",))
    params, batch = model(8 * 2, 128)
    params = staged(mesh, params)
    micro = jax.eval_shape(lambda: batch)
    functions = (stage_fn, loss_fn, embed_fn)
    return "tanh_stage8_R2", mesh, functions, params, micro, {"repeats": 2}


def staged(mesh, params):
    return (
        params[0],
        jax.device_put(params[1], NamedSharding(mesh, P("stage"))),
        params[2],
    )


def plan_for(task, **options):
    _, mesh, (stage, loss, embed), params, micro, layout = task
    return jaxaccum.plan_pipeline(
        stage, loss, params, micro, mesh=mesh, embed_fn=embed, **layout, **options
    )


def remat_recompute_flops(task, num) -> dict:
    """What remat adds to the compiled window, against a stage's forward.

    XLA's cost analysis counts a loop's body once, so the rolled window's
    FLOPs with remat less those without are one tick's recomputed forward
    (of the device's stage, on one micro-batch): compared with one stage's
    forward FLOPs, compiled alone. (Unrolling the loop would count every
    tick, but unrolled XLA may merge the recomputed forward with the
    forward, which the rolled loop cannot: it would not measure the program
    that runs.)"""
    _, mesh, (stage, loss, embed), params, micro, layout = task
    batch = jax.tree.map(
        lambda s: jnp.zeros((s.shape[0] * num, *s.shape[1:]), s.dtype), micro
    )
    flops = {}
    for remat in (False, True):
        step = jaxaccum.pipeline_value_and_grad(
            stage, loss, num, mesh=mesh, embed_fn=embed, remat=remat, **layout
        )
        flops[remat] = jax.jit(step).lower(params, batch).compile().cost_analysis()
    rows = micro_rows(task)
    piece = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((rows, *s.shape[1:]), s.dtype), micro
    )
    x = jax.eval_shape(embed, params[0], piece)
    one_stage = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), params[1]
    )
    forward = jax.jit(stage).lower(one_stage, x).compile().cost_analysis()
    return {
        "num_microbatches": num,
        "added_flops": flops[True]["flops"] - flops[False]["flops"],
        "stage_forward_flops": forward["flops"],
    }


def micro_rows(task) -> int:
    """Rows of one micro-batch on one data shard."""
    _, mesh, _, _, micro, layout = task
    shards = mesh.shape[layout["data_axis"]] if "data_axis" in layout else 1
    return jax.tree.leaves(micro)[0].shape[0] // shards


def evaluate(task) -> dict:
    name = task[0]
    table = {}
    first = None
    num_stages = task[1].shape["stage"]
    candidates = [num_stages * 2**k for k in range(5)]
    repeats = task[5].get("repeats", 1)  # "1f1b" with R > 1: interleaved
    schedules = tuple(name for name in REGISTERED if builds(name, repeats))
    for schedule, remat, num in itertools.product(schedules, (False, True), candidates):
        one = plan_for(
            task,
            memory_budget=2**40,
            candidates=[num],
            schedule=schedule,
            remat=remat,
        )
        first = first or one
        table[schedule, remat, num] = (one.footprint_bytes, one.efficiency)
    footprints = sorted(f for f, _ in table.values())
    budgets = np.geomspace(footprints[0], footprints[-1], NUM_BUDGETS).astype(int)
    budgets[-1] = footprints[-1]
    fixed_scores = {
        setting: [table[setting][1] if table[setting][0] <= b else 0.0 for b in budgets]
        for setting in table
    }
    best_fixed = max(fixed_scores, key=lambda s: np.mean(fixed_scores[s]))
    rows = []
    for index, budget in enumerate(budgets):
        chosen = plan_for(task, memory_budget=int(budget), candidates=candidates)
        oracle = max(e for f, e in table.values() if f <= budget)
        gpipe = [e for k, (f, e) in table.items() if k[0] == "gpipe" and f <= budget]
        rows.append(
            {
                "budget_bytes": int(budget),
                "planned": {
                    "num_microbatches": chosen.num_microbatches,
                    "schedule": chosen.schedule,
                    "remat": bool(chosen.remat),
                    "efficiency": chosen.efficiency,
                    "footprint_bytes": chosen.footprint_bytes,
                    "compiled": len(chosen.rows),
                },
                "exhaustive_best_efficiency": oracle,
                "gpipe_only_efficiency": max(gpipe, default=0.0),
                "best_fixed_efficiency": fixed_scores[best_fixed][index],
            }
        )
    planned = [row["planned"]["efficiency"] for row in rows]
    return {
        "task": name,
        "recompute": first.recompute,
        "remat_recompute": remat_recompute_flops(task, num_stages),
        "table": [
            {
                "schedule": kind,
                "remat": r,
                "num_microbatches": m,
                "footprint_bytes": f,
                "efficiency": e,
            }
            for (kind, r, m), (f, e) in sorted(table.items())
        ],
        "best_fixed": {
            "schedule": best_fixed[0],
            "remat": best_fixed[1],
            "num_microbatches": best_fixed[2],
        },
        "rows": rows,
        "mean_efficiency": {
            "planned": float(np.mean(planned)),
            "best_fixed": float(np.mean(fixed_scores[best_fixed])),
            "gpipe_only": float(np.mean([r["gpipe_only_efficiency"] for r in rows])),
        },
        "best_fixed_out_of_memory": int(sum(table[best_fixed][0] > b for b in budgets)),
        "planned_equals_exhaustive": all(
            row["planned"]["efficiency"] == row["exhaustive_best_efficiency"]
            for row in rows
        ),
    }


def main() -> None:
    results = [evaluate(task) for task in (mlp_task(), tanh_task())]
    for result in results:
        print(
            f"{result['task']}: mean efficiency planned "
            f"{result['mean_efficiency']['planned']:.3f}, best fixed "
            f"{result['best_fixed']} {result['mean_efficiency']['best_fixed']:.3f} "
            f"(out of memory at {result['best_fixed_out_of_memory']} of "
            f"{NUM_BUDGETS} budgets); planned = exhaustive at every budget: "
            f"{result['planned_equals_exhaustive']}; remat adds "
            f"{result['remat_recompute']['added_flops']:.4g} FLOPs a tick, a "
            f"stage's forward {result['remat_recompute']['stage_forward_flops']:.4g}"
        )
        for row in result["rows"]:
            planned = row["planned"]
            print(
                f"  budget {row['budget_bytes'] / 2**20:8.2f} MiB: M="
                f"{planned['num_microbatches']:3d} {planned['schedule']:5} "
                f"remat={planned['remat']!s:5} "
                f"eff {planned['efficiency']:.3f} (exhaustive "
                f"{row['exhaustive_best_efficiency']:.3f}, best fixed "
                f"{row['best_fixed_efficiency']:.3f}), {planned['compiled']} compiled"
            )
    write_json("pipeline_plan", {"tasks": {r["task"]: r for r in results}})


if __name__ == "__main__":
    main()
