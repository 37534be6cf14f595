"""Zero-bubble's, interleaved 1F1B's and the V schedules' compiled
temporaries against 1F1B's (issue 74).

``jaxaccum.pipeline_value_and_grad`` at S = 4 stages x data = 2 on the 8
forced CPU devices, M = 2S, 4S, 8S micro-batches, every schedule running the
same layers on the same devices, with and without ``remat``, on two models
of different width-to-hidden ratio, each with 1- and 2-layer stages:

* ``dense``: ``pipeline.py``'s benchmark model, tanh layers 256 wide (no
  hidden width: ratio 1);
* ``residual``: a residual stack ``x + tanh(x W1 + b1) W2``, width 32,
  hidden 64 (ratio 1:2).

Per configuration: each schedule's temporaries per device
(``memory_analysis().temp_size_in_bytes``, nothing is timed), in the
model's activations (one micro-batch's rows at its width), their ratio
zero-bubble / 1F1B, zero-bubble's rings (residual and stored-boundary slots)
and inboxes, and its modeled window against the asynchronous ZB-H1's
``3 M + S - 1``; and per (model, stage, remat) the flatness in M (M = 8S
against M = 2S). Interleaved 1F1B (``repeats=2``: 2S chunks of 1 or 2
layers, without remat) against 1F1B on the same layers (S stages of twice
the chunk's layers): its temporaries, their ratio, its flatness in M, each
also with the stages stacked as the devices hold them (``stage_order=
"device"``: no relayout, each op reading its chunk in place). The
V schedules (``"v-zb"`` and ``"v-half"``, ``repeats=2``, without remat: not
built) on the same 2S chunks, against the same 1F1B: their temporaries,
ratios, slots (residual ring, stored boundaries, inboxes, in chunk
activations), modeled windows (in whole stages' forward, a chunk op half of
one) against 1F1B's ``3 (M + S - 1)``, and flatness in M.

Run: python benchmarks/pipeline_memory.py   (writes
benchmarks/results/pipeline_memory.json; a few minutes)
"""

import itertools
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
from jaxaccum._pipeline._zero_bubble import ZeroBubble  # noqa: E402
from jaxaccum.cli.harness import machine  # noqa: E402

STAGES, DATA, ROWS, INPUTS = 4, 2, 64, 4
FACTORS = (2, 4, 8)  # M = factor * S
MODELS = {"dense": (256, None), "residual": (32, 64)}  # name: (width, hidden)


def stage_for(name: str, layers: int):
    """The stage function of ``layers`` layers of model ``name``."""

    def dense(params, x):
        for layer in range(layers):
            x = jnp.tanh(x @ params["w"][layer] + params["b"][layer])
        return x

    def residual(params, x):
        for layer in range(layers):
            h = jnp.tanh(x @ params["w1"][layer] + params["b1"][layer])
            x = x + h @ params["w2"][layer]
        return x

    return dense if name == "dense" else residual


def embed_fn(params, micro_batch):
    return micro_batch["x"] @ params["w"]


def loss_fn(params, x, micro_batch):
    return jnp.mean((x @ params["w"] - micro_batch["y"]) ** 2)


def model(name: str, layers: int, rows: int, repeats: int = 1) -> tuple:
    """Parameters ``(embed, stages, head)`` (``S R`` stages of ``layers``
    layers) and a batch of ``rows``."""
    width, hidden = MODELS[name]
    keys = jax.random.split(jax.random.key(0), 6)
    shape = (STAGES * repeats, layers)
    if hidden is None:
        stages = {
            "w": jax.random.orthogonal(keys[1], width, shape),
            "b": jnp.zeros((*shape, width)),
        }
    else:
        stages = {
            "w1": jax.random.normal(keys[1], (*shape, width, hidden)) / width**0.5,
            "b1": jnp.zeros((*shape, hidden)),
            "w2": jax.random.normal(keys[2], (*shape, hidden, width)) / hidden**0.5,
        }
    params = (
        {"w": jax.random.normal(keys[0], (INPUTS, width)) / INPUTS**0.5},
        stages,
        {"w": jax.random.normal(keys[3], (width, 1)) / width**0.5},
    )
    batch = {
        "x": jax.random.normal(keys[4], (rows, INPUTS)),
        "y": jax.random.normal(keys[5], (rows, 1)),
    }
    return params, batch


def temporaries(
    name: str,
    layers: int,
    num: int,
    schedule: str,
    remat: bool,
    repeats: int = 1,
    stage_order: str = "model",
) -> float:
    """The step's temporaries per device, in the model's activations (the
    stages stacked in ``stage_order``)."""
    mesh = jax.make_mesh((STAGES, DATA), ("stage", "data"))
    params, batch = model(name, layers, ROWS * num * DATA, repeats)
    if stage_order == "device":
        order = jaxaccum.pipeline_stage_order(STAGES, repeats, schedule)
        params = (params[0], jax.tree.map(lambda p: p[order], params[1]), params[2])
    replicated, staged = NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))
    params = jax.device_put(params, (replicated, staged, replicated))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    step = jaxaccum.pipeline_value_and_grad(
        stage_for(name, layers),
        loss_fn,
        num,
        mesh=mesh,
        embed_fn=embed_fn,
        data_axis="data",
        schedule=schedule,
        remat=remat,
        repeats=repeats,
        stage_order=stage_order,
    )
    compiled = jax.jit(step).lower(params, batch).compile()
    activation = ROWS * MODELS[name][0] * 4
    return compiled.memory_analysis().temp_size_in_bytes / activation


def row(name: str, layers: int, num: int, remat: bool) -> dict:
    """One configuration: both schedules' temporaries and zero-bubble's grid."""
    zero = temporaries(name, layers, num, "zero-bubble", remat)
    one = temporaries(name, layers, num, "1f1b", remat)
    schedule = ZeroBubble.for_window(STAGES, num, 1, remat)
    grid = schedule.grid()
    return {
        "zero_bubble_temp_activations": zero,
        "one_f_one_b_temp_activations": one,
        "ratio": zero / one,
        "ring_slots": grid.ring_size,
        "stored_slots": grid.stored_size,
        "inbox_slots": 0 if grid.immediate else grid.inbox_size + grid.back_size,
        "modeled_window": schedule.modeled_window(),
        "async_zb_h1_window": 3.0 * num + STAGES - 1,
    }


def chunked_rows(name: str, layers: int, num: int) -> dict:
    """The schedules of ``R = 2`` chunks of ``layers`` layers a device
    (interleaved 1F1B, v-zb, v-half) against 1F1B on the same layers
    (stages of ``2 layers``): ``{schedule: row}``."""
    one = temporaries(name, 2 * layers, num, "1f1b", False)
    mine = temporaries(name, layers, num, "1f1b", False, repeats=2)
    held = temporaries(name, layers, num, "1f1b", False, 2, "device")
    rows = {
        "interleaved": {
            "interleaved_temp_activations": mine,
            "one_f_one_b_temp_activations": one,
            "ratio": mine / one,
            "device_order": {"temp_activations": held, "ratio": held / one},
        }
    }
    for cls in (VShape, VHalf):
        temps = temporaries(name, layers, num, cls.name, False, repeats=2)
        held = temporaries(name, layers, num, cls.name, False, 2, "device")
        schedule = cls(STAGES, num, 2)
        tables = schedule.tables()
        rows[cls.name] = {
            "temp_activations": temps,
            "one_f_one_b_temp_activations": one,
            "ratio": temps / one,
            "device_order": {"temp_activations": held, "ratio": held / one},
            "slots_chunk_activations": {
                "ring": tables.ring_size,
                "stored": tables.stored_size,
                "inbox": tables.inbox_size,
                "back_inbox": tables.back_size,
            },
            "window_stages": schedule.modeled_window() / 2,
            "one_f_one_b_window_stages": OneFOneB(STAGES, num).modeled_window(),
        }
    return rows


def main() -> None:
    rows, flat = {}, {}
    for name, layers, remat in itertools.product(MODELS, (1, 2), (False, True)):
        config = f"{name}_L{layers}_{'remat' if remat else 'plain'}"
        for factor in FACTORS:
            num = factor * STAGES
            rows[f"{config}_M{num}"] = row(name, layers, num, remat)
            print(config, num, rows[f"{config}_M{num}"], flush=True)
        small, big = (
            rows[f"{config}_M{f * STAGES}"]["zero_bubble_temp_activations"]
            for f in (FACTORS[0], FACTORS[-1])
        )
        flat[config] = big / small
    kinds = {"interleaved": "interleaved_temp_activations"}
    kinds |= {"v-zb": "temp_activations", "v-half": "temp_activations"}
    for name, layers in itertools.product(MODELS, (1, 2)):
        for factor in FACTORS:
            num = factor * STAGES
            for kind, row_of in chunked_rows(name, layers, num).items():
                rows[f"{kind}_{name}_L{layers}_M{num}"] = row_of
                print(kind, name, layers, num, row_of, flush=True)
        for kind, key in kinds.items():
            config = f"{kind}_{name}_L{layers}"
            small, big = (
                rows[f"{config}_M{f * STAGES}"][key] for f in (FACTORS[0], FACTORS[-1])
            )
            flat[config] = big / small
            small, big = (
                rows[f"{config}_M{f * STAGES}"]["device_order"]["temp_activations"]
                for f in (FACTORS[0], FACTORS[-1])
            )
            flat[f"{config}_device_order"] = big / small
    write_json(
        "pipeline_memory",
        {
            "machine": machine(),
            "stages": STAGES,
            "data_shards": DATA,
            "rows_per_microbatch_per_shard": ROWS,
            "models": {k: {"width": w, "hidden": h} for k, (w, h) in MODELS.items()},
            "rows": rows,
            "8s_over_2s": flat,
        },
    )


if __name__ == "__main__":
    main()
