"""cached_value_and_grad on a batch sharded over 8 CPU devices under plain
``jit`` (XLA's sharding propagation, an Auto mesh), run by test_cached.py in
its own process (``--xla_force_host_platform_device_count=8``).

Each check compares the sharded step with the single-device big batch's
``jax.value_and_grad`` (chex, RTOL and ATOL of tests/tolerances.py) and
reports the collectives XLA put in the compiled program, inside and outside
its loops. Under plain ``jit`` XLA all-reduces the replicated parameters'
gradient in each pass-2 iteration (the accumulator is replicated); one
reduction per step needs the window per device (``mesh=``, ``data_axis=``,
as ``shard_value_and_grad`` takes them), not built yet. Prints one JSON
object, ``{check name: {"ok": bool, "detail": str}}``, as the last line of
stdout.
"""

import sys

import chex
import jax
import jax.numpy as jnp
from check_scripts import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum
from jaxaccum.testing import find_collectives

BATCH_SIZE = 64  # 8 rows per device; N = 8 leaves one per device and micro-batch
FEATURES, EMBED = 6, 4
CHECKS = [
    f"{axis_type}_data_sharded_n{num}"
    for axis_type in ("auto", "explicit")
    for num in (2, 8)
]


def encode(params, batch):
    return {
        "image": jnp.tanh(batch["image"] @ params["image"]),
        "text": jnp.tanh(batch["text"] @ params["text"]),
    }


def clip_loss(params, outputs):
    """CLIP's symmetric InfoNCE, written so that an Explicit mesh resolves
    every sharding: the positives from rows on the same devices, the texts
    gathered once for the B x B logits."""
    image, text = outputs["image"], outputs["text"]
    scale = jnp.exp(params["log_scale"])
    positive = scale * jnp.mean(jnp.sum(image * text, axis=-1))
    if jax.typeof(text).sharding.mesh.axis_types == (AxisType.Explicit,):
        text = jax.sharding.reshard(text, P())
    logits = scale * image @ text.T
    image_to_text = jnp.mean(jax.nn.logsumexp(logits, axis=1))
    text_to_image = jnp.mean(jax.nn.logsumexp(logits, axis=0))
    return (image_to_text + text_to_image) / 2 - positive


def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "image": jax.random.normal(keys[0], (FEATURES, EMBED)) / FEATURES**0.5,
        "text": jax.random.normal(keys[1], (FEATURES, EMBED)) / FEATURES**0.5,
        "log_scale": jnp.asarray(1.0),
    }
    batch = {
        "image": jax.random.normal(keys[2], (BATCH_SIZE, FEATURES)),
        "text": jax.random.normal(keys[3], (BATCH_SIZE, FEATURES)),
    }
    return params, batch


def check_sharded(axis_type, num_microbatches):
    """The batch's rows over the 8 devices, the parameters replicated, on an
    Auto mesh (XLA propagates the shardings) or an Explicit one (the loss
    gathers what it needs)."""
    axis_types = (AxisType.Auto if axis_type == "auto" else AxisType.Explicit,)
    mesh = jax.make_mesh((8,), ("data",), axis_types=axis_types)
    params, batch = inputs()
    reference = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, encode(p, b))))(
        params, batch
    )
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    placed = (jax.device_put(params, replicated), jax.device_put(batch, rows))
    step = jax.jit(
        jaxaccum.cached_value_and_grad(encode, clip_loss, num_microbatches),
        in_shardings=(replicated, rows),
    )
    with jax.set_mesh(mesh):
        compiled = step.lower(*placed).compile()
        out = compiled(*placed)
    chex.assert_trees_all_close(out, reference, rtol=RTOL, atol=ATOL)
    assert len(placed[1]["image"].sharding.device_set) == 8
    collectives = find_collectives(compiled)
    in_loop = [f"{c.op} {c.shapes}" for c in collectives if c.in_loop]
    return (
        f"{len(collectives)} collectives ("
        + ", ".join(sorted({c.op for c in collectives}))
        + f"), inside loops: {in_loop}"
    )


def run(name):
    axis_type, num = name.split("_data_sharded_n")
    return check_sharded(axis_type, int(num))


def main():
    report(CHECKS, run, 8)


if __name__ == "__main__":
    sys.exit(main())
