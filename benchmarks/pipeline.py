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
  micro-batch's activation.

Run: ``python benchmarks/pipeline.py``; writes ``benchmarks/results/pipeline.json``
and prints a table.
"""

import os

# Before JAX starts its CPU backend (on first use, not at import).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import write_json  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxaccum  # noqa: E402
import jaxaccum.testing  # noqa: E402

NUM_DEVICES = 8
STAGES = (2, 4, 8)
MICROBATCH_FACTORS = (1, 2, 4, 8)  # M = factor * S
WIDTH, INPUTS, LAYERS_PER_STAGE, ROWS = 256, 4, 2, 64
NESTED_STEPS = 2


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
    return row


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


def main() -> None:
    assert jax.device_count() == NUM_DEVICES, (
        f"{jax.device_count()} devices: XLA_FLAGS was applied too late"
    )
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
        },
    )
    print_rows(rows)


if __name__ == "__main__":
    main()
