"""V-ZB's and V-Half's compiled temporaries against 1F1B's, zero-bubble's and
interleaved 1F1B's (issue 74, item 3), every schedule running the same
layers on the same devices.

``jaxaccum.pipeline_value_and_grad`` at S = 4 stages x data = 2 on the 8
forced CPU devices, M = 2S, 4S micro-batches, no remat, on
``pipeline_memory.py``'s dense model (tanh layers 256 wide): ``2 S`` chunks
of ``L`` layers each. ``schedule="v-zb"``, ``"v-half"`` and interleaved ``"1f1b"`` with
``repeats=2`` stack the ``2 S`` chunks (device ``d`` holds two); ``"1f1b"``
and ``"zero-bubble"`` with ``repeats=1`` stack ``S`` stages of ``2 L``
layers (the same two chunks' layers on each device, so the same model).

Per configuration each schedule's temporaries per device
(``memory_analysis().temp_size_in_bytes``, compiled at backend
optimisation level 0: the HLO passes that decide them are the same; nothing
is timed), in activations (one micro-batch's rows at the width), and
each V's slots (residual ring, stored boundaries, inboxes, in chunk
activations) and modeled window (in whole stages' forward, a chunk op half
of one) against 1F1B's ``3 (M + S - 1)``.

Run: python benchmarks/pipeline_v_shape_memory.py   (writes
benchmarks/results/pipeline_v_shape_memory.json; a minute or two)
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
from jaxaccum._pipeline._1f1b import OneFOneB  # noqa: E402
from jaxaccum._pipeline._v_shape import VHalf, VShape  # noqa: E402

STAGES, DATA, ROWS, INPUTS, WIDTH = 4, 2, 64, 4, 256
LAYERS = (1, 2)  # layers of one chunk (half a device's)
FACTORS = (2, 4)  # M = factor * S
# schedule name: (repeats, chunks a stacked stage holds)
SCHEDULES = {
    "v-zb": (2, 1),
    "v-half": (2, 1),
    "1f1b": (1, 2),
    "zero-bubble": (1, 2),
    "interleaved": (2, 1),
}


def dense(params, x):
    for layer in range(params["w"].shape[0]):
        x = jnp.tanh(x @ params["w"][layer] + params["b"][layer])
    return x


def embed_fn(params, micro_batch):
    return micro_batch["x"] @ params["w"]


def loss_fn(params, x, micro_batch):
    return jnp.mean((x @ params["w"] - micro_batch["y"]) ** 2)


def model(stacked: int, layers: int, rows: int) -> tuple:
    """Parameters ``(embed, stages, head)``: ``stacked`` stages of ``layers``
    dense layers; a batch of ``rows``."""
    keys = jax.random.split(jax.random.key(0), 5)
    shape = (stacked, layers)
    stages = {
        "w": jax.random.orthogonal(keys[1], WIDTH, shape),
        "b": jnp.zeros((*shape, WIDTH)),
    }
    params = (
        {"w": jax.random.normal(keys[0], (INPUTS, WIDTH)) / INPUTS**0.5},
        stages,
        {"w": jax.random.normal(keys[2], (WIDTH, 1)) / WIDTH**0.5},
    )
    batch = {
        "x": jax.random.normal(keys[3], (rows, INPUTS)),
        "y": jax.random.normal(keys[4], (rows, 1)),
    }
    return params, batch


def temporaries(kind: str, chunk_layers: int, num: int) -> float:
    """The step's temporaries per device, in activations."""
    repeats, chunks = SCHEDULES[kind]
    mesh = jax.make_mesh((STAGES, DATA), ("stage", "data"))
    params, batch = model(STAGES * repeats, chunks * chunk_layers, ROWS * num * DATA)
    replicated, staged = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
    params = jax.device_put(params, (replicated, staged, replicated))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    step = jaxaccum.pipeline_value_and_grad(
        dense,
        loss_fn,
        num,
        mesh=mesh,
        embed_fn=embed_fn,
        data_axis="data",
        schedule="1f1b" if kind == "interleaved" else kind,
        repeats=repeats,
    )
    lowered = jax.jit(step).lower(params, batch)
    compiled = lowered.compile({"xla_backend_optimization_level": 0})
    return compiled.memory_analysis().temp_size_in_bytes / (ROWS * WIDTH * 4)


def main() -> None:
    rows = {}
    for layers in LAYERS:
        for factor in FACTORS:
            num = factor * STAGES
            temps = {kind: temporaries(kind, layers, num) for kind in SCHEDULES}
            row: dict = {
                "temp_activations": temps,
                "one_f_one_b_window_stages": OneFOneB(STAGES, num).modeled_window(),
            }
            for name, cls in (("v_zb", VShape), ("v_half", VHalf)):
                schedule = cls(STAGES, num, 2)
                tables = schedule.tables()
                row[f"{name}_over_1f1b"] = temps[cls.name] / temps["1f1b"]
                row[f"{name}_slots_chunk_activations"] = {
                    "ring": tables.ring_size,
                    "stored": tables.stored_size,
                    "inbox": tables.inbox_size,
                    "back_inbox": tables.back_size,
                }
                row[f"{name}_window_stages"] = schedule.modeled_window() / 2
            rows[f"L{layers}_M{num}"] = row
            print(f"chunk layers {layers} M={num}:", row, flush=True)
    write_json(
        "pipeline_v_shape_memory",
        {
            "stages": STAGES,
            "data_shards": DATA,
            "rows_per_microbatch_per_shard": ROWS,
            "width": WIDTH,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
