"""The stacked stages in model order against device order (issue 74), timed.

``jaxaccum.pipeline_value_and_grad`` at S = 4 stages x data = 2 on the 8
forced CPU devices, M = 16, ``pipeline_memory.py``'s two models with chunks
of one layer: interleaved 1F1B and v-half (``repeats=2``) with the stages in
model order (relaid out once a step and held through the loop) and stacked
as the devices hold them (``stage_order="device"``: nothing relaid out, each
op copying its one chunk on XLA:CPU), beside 1F1B on the same layers (S
stages of two). Per contender: milliseconds per step over interleaved
rounds (each round takes the contenders in a seeded order of its own), min
/ median / max; per round the device order's time over the model order's;
the compiled temporaries (in the model's activations) and the collectives
outside the loop (``all-to-all`` and ``collective-permute``, read from the
compiled HLO).

These are 8 CPU devices sharing 2 cores: the ratios within a round are the
evidence, not the milliseconds.

Run: python benchmarks/pipeline_stage_order.py   (writes
benchmarks/results/pipeline_stage_order.json; a few minutes)
"""

import random
import time

import jax
import pipeline_memory as pm  # sets the 8 devices before JAX starts
from common import spread, write_json
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._plan._hlo import find_collectives
from jaxaccum.cli.harness import machine

NUM, ROUNDS, CALLS_PER_ROUND = 16, 9, 3
CONTENDERS = {  # name: (schedule, repeats, layers a stage, stage_order)
    "1f1b": ("1f1b", 1, 2, "model"),
    "interleaved_model": ("1f1b", 2, 1, "model"),
    "interleaved_device": ("1f1b", 2, 1, "device"),
    "v-half_model": ("v-half", 2, 1, "model"),
    "v-half_device": ("v-half", 2, 1, "device"),
}


def compiled(name: str, schedule: str, repeats: int, layers: int, order: str):
    """The contender's compiled step, its arguments and its compiled reads."""
    mesh = jax.make_mesh((pm.STAGES, pm.DATA), ("stage", "data"))
    params, batch = pm.model(name, layers, pm.ROWS * NUM * pm.DATA, repeats)
    if order == "device":
        stage_order = jaxaccum.pipeline_stage_order(pm.STAGES, repeats, schedule)
        params = (
            params[0],
            jax.tree.map(lambda p: p[stage_order], params[1]),
            params[2],
        )
    replicated, staged = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
    params = jax.device_put(params, (replicated, staged, replicated))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    step = jaxaccum.pipeline_value_and_grad(
        pm.stage_for(name, layers),
        pm.loss_fn,
        NUM,
        mesh=mesh,
        embed_fn=pm.embed_fn,
        data_axis="data",
        schedule=schedule,
        repeats=repeats,
        stage_order=order,
    )
    program = jax.jit(step).lower(params, batch).compile()
    jax.block_until_ready(program(params, batch))
    activation = pm.ROWS * pm.MODELS[name][0] * 4
    moved = [
        c.op
        for c in find_collectives(program)
        if not c.in_loop and c.op in ("all-to-all", "collective-permute")
    ]
    reads = {
        "temp_activations": program.memory_analysis().temp_size_in_bytes / activation,
        "moved_outside_loop": {op: moved.count(op) for op in sorted(set(moved))},
    }
    return program, (params, batch), reads


def timed(programs: dict, seed: int) -> dict[str, list[float]]:
    """Milliseconds per step, interleaved rounds in seeded orders."""
    order, times = random.Random(seed), {name: [] for name in programs}
    for _ in range(ROUNDS):
        names = list(programs)
        order.shuffle(names)
        for name in names:
            program, args = programs[name]
            start = time.perf_counter()
            for _ in range(CALLS_PER_ROUND):
                out = program(*args)
            jax.block_until_ready(out)
            times[name].append(1e3 * (time.perf_counter() - start) / CALLS_PER_ROUND)
    return times


def model_rows(name: str, seed: int) -> dict:
    """Every contender on model ``name``."""
    programs, reads = {}, {}
    for kind, config in CONTENDERS.items():
        program, args, reads[kind] = compiled(name, *config)
        programs[kind] = (program, args)
    times = timed(programs, seed)
    row = {kind: {"ms": spread(times[kind]), **reads[kind]} for kind in programs}
    for kind in ("interleaved", "v-half"):
        device, model = times[f"{kind}_device"], times[f"{kind}_model"]
        row[f"{kind}_device_over_model"] = spread(
            [d / m for d, m in zip(device, model, strict=True)]
        )
    return row


def main() -> None:
    rows = {name: model_rows(name, seed) for seed, name in enumerate(pm.MODELS)}
    for name, row in rows.items():
        print(name, row, flush=True)
    write_json(
        "pipeline_stage_order",
        {
            "machine": machine(),
            "stages": pm.STAGES,
            "data_shards": pm.DATA,
            "num_microbatches": NUM,
            "rounds": ROUNDS,
            "calls_per_round": CALLS_PER_ROUND,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
