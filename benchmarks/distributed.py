"""Deferred vs per-micro-batch gradient all-reduce, data parallel on 8 CPU devices.

The same accumulated step two ways, on a batch sharded over 8 forced CPU
devices (``--xla_force_host_platform_device_count=8``):

* per-micro-batch: ``jaxaccum.value_and_grad`` on the sharded batch; XLA's SPMD
  partitioner all-reduces each micro-batch's gradient inside the loop;
* deferred: ``jaxaccum.shard_value_and_grad``; each device accumulates its own
  rows and one all-reduce runs after the loop.

For N in {2, 4, 8, 16} (global batch fixed, so the micro-batch shrinks as N
grows) we record the all-reduces of the compiled HLO, inside and outside the
loop, and the median step time. Both are timed in the same run, alternately,
and the ratio is the median of per-round ratios. Forced CPU devices share one
process and this machine's cores, so an all-reduce is a memory copy between
threads: far cheaper than over a real interconnect, which is where deferring
pays (MaxText measured up to 1.28x at 8 micro-batches on TPU).

Sharded parameters (``--sharded``, also run by default): the same MLP, 3 hidden
layers of 1024, FSDP-sharded over the 8 devices (axis 0 of every kernel;
biases replicated), for each ``param_gather`` x ``grad_reduce`` mode of
``shard_value_and_grad`` and for ``value_and_grad`` (XLA's SPMD partitioner):
bytes the collectives move per window and per device (from the compiled HLO:
outside the loop once, inside it N times) and the per-device compiled
footprint (``memory_analysis()``). Both are exact and CPU-stable; nothing is
timed.

Run: ``python benchmarks/distributed.py [--sharded]``; writes
``benchmarks/results/distributed.json`` (and ``sharded.json``) and prints tables.
"""

import os

# Before JAX starts its CPU backend (on first use, not at import).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import chex  # noqa: E402
import jax  # noqa: E402
from common import write_json  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402
from jaxaccum.cli.models import mlp_task  # noqa: E402

NUM_DEVICES = 8
# (features, hidden, classes): 4.4 KiB of gradients, to see the fixed cost of an
# all-reduce, and 1.3 MiB, to see the cost of its data.
MODELS = ((128, (8,), 10), (128, (512, 512), 10))
BATCH_SIZE = 1024
NUM_MICROBATCHES = (2, 4, 8, 16)
ROUNDS = 15


def timed(fun, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fun(*args))
    return time.perf_counter() - start


def measure(task, mesh, num: int) -> dict:
    """All-reduce counts and median step times of both modes at N=num."""
    params = jax.device_put(task.params, NamedSharding(mesh, P()))
    batch = jaxaccum.shard_batch(task.make_batch(jax.random.key(0), BATCH_SIZE), mesh)
    steps = {
        "per_microbatch": jax.jit(jaxaccum.value_and_grad(task.loss, num)),
        "deferred": jax.jit(jaxaccum.shard_value_and_grad(task.loss, num)),
    }
    row = {
        "model": task.name,
        "gradient_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(params)),
        "num_microbatches": num,
    }
    for name, step in steps.items():
        counts = jaxaccum.testing.count_collectives(step.lower(params, batch).compile())
        row[f"{name}_all_reduce"] = counts["all-reduce"]
    # Same numbers both ways (this also warms both up): the same float32 sums
    # of BATCH_SIZE rows in another order, at most 2 B u apart (u = 2**-24;
    # Higham, 4.2), times sum|t| (< 1 on this unit-scale data) where they cancel.
    tolerance = 2 * BATCH_SIZE * 2.0**-24
    chex.assert_trees_all_close(
        *(step(params, batch) for step in steps.values()),
        rtol=tolerance,
        atol=tolerance,
    )
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(timed(step, params, batch))
    for name in steps:
        row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
    row["speedup"] = statistics.median(
        per / deferred
        for per, deferred in zip(
            times["per_microbatch"], times["deferred"], strict=True
        )
    )
    # What each of the N - 1 all-reduces saved cost.
    row["ms_per_saved_all_reduce"] = (row["per_microbatch_ms"] - row["deferred_ms"]) / (
        num - 1
    )
    return row


SHARDED_MODEL = (128, (1024, 1024, 1024), 10)
MODES = [
    (gather, reduce)
    for gather in ("window", "microbatch")
    for reduce in ("window", "microbatch")
]


def total_bytes(analysis) -> int:
    """The footprint jaxaccum.plan reports: arguments + outputs + temporaries
    - aliased."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def sharded_rows(mesh) -> list[dict]:
    """Bytes per window and per-device memory of each mode, N in 2..16."""
    task = mlp_task(*SHARDED_MODEL)

    def spec(leaf):  # kernels over "data" on axis 0; biases replicated
        return P("data") if leaf.ndim == 2 else P()

    params = jax.device_put(
        task.params, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), task.params)
    )
    batch = jaxaccum.shard_batch(task.make_batch(jax.random.key(0), BATCH_SIZE), mesh)
    steps = {"value_and_grad": lambda num: jaxaccum.value_and_grad(task.loss, num)}
    for gather, reduce in MODES:
        steps[f"{gather}/{reduce}"] = lambda num, g=gather, r=reduce: (
            jaxaccum.shard_value_and_grad(task.loss, num, param_gather=g, grad_reduce=r)
        )
    rows = []
    for num in NUM_MICROBATCHES:
        for mode, make in steps.items():
            compiled = jax.jit(make(num)).lower(params, batch).compile()
            rows.append(
                {
                    "mode": mode,
                    "num_microbatches": num,
                    "window_bytes": jaxaccum.testing.window_bytes(compiled, num),
                    "device_bytes": total_bytes(compiled.memory_analysis()),
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                }
            )
    return rows


def print_sharded(rows: list[dict]) -> None:
    print(
        f"FSDP MLP {SHARDED_MODEL}, batch {BATCH_SIZE} over {NUM_DEVICES} devices: "
        "bytes communicated per window / per-device footprint (MiB)"
    )
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    print(f"{'N':>3}  " + "  ".join(f"{mode:>21}" for mode in modes))
    for num in NUM_MICROBATCHES:
        cells = []
        for mode in modes:
            (row,) = (
                r for r in rows if r["mode"] == mode and r["num_microbatches"] == num
            )
            moved, held = row["window_bytes"], row["device_bytes"]
            cells.append(f"{moved / 2**20:>9.2f} / {held / 2**20:>9.2f}")
        print(f"{num:>3}  " + "  ".join(f"{cell:>21}" for cell in cells))


def main() -> None:
    assert jax.device_count() == NUM_DEVICES, (
        f"{jax.device_count()} devices: XLA_FLAGS was applied too late"
    )
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
    with jax.set_mesh(mesh):
        rows = sharded_rows(mesh)
    write_json(
        "sharded",
        {
            "batch_size": BATCH_SIZE,
            "devices": NUM_DEVICES,
            "model": SHARDED_MODEL,
            "rows": rows,
        },
    )
    print_sharded(rows)
    if "--sharded" in sys.argv[1:]:
        return
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
    with jax.set_mesh(mesh):
        rows = [
            measure(mlp_task(*model), mesh, num)
            for model in MODELS
            for num in NUM_MICROBATCHES
        ]
    write_json(
        "distributed",
        {
            "batch_size": BATCH_SIZE,
            "devices": NUM_DEVICES,
            "rounds": ROUNDS,
            "rows": rows,
        },
    )
    print(f"batch {BATCH_SIZE} over {NUM_DEVICES} forced CPU devices")
    print(
        f"{'model':<20} {'grads':>9} {'N':>3}  {'all-reduce loop/after':>21}  "
        f"{'per-micro ms':>12}  {'deferred ms':>11}  {'speedup':>7}  "
        f"{'ms/saved':>8}"
    )
    for row in rows:
        per, deferred = row["per_microbatch_all_reduce"], row["deferred_all_reduce"]
        reduces = (
            f"{per['loop']}/{per['outside']} -> {deferred['loop']}/"
            f"{deferred['outside']}"
        )
        print(
            f"{row['model']:<20} {row['gradient_bytes'] / 2**10:>5.0f} KiB "
            f"{row['num_microbatches']:>3}  {reduces:>21}  "
            f"{row['per_microbatch_ms']:>12.2f}  {row['deferred_ms']:>11.2f}  "
            f"{row['speedup']:>6.2f}x  {row['ms_per_saved_all_reduce']:>8.2f}"
        )


if __name__ == "__main__":
    main()
