"""jaxaccum.losses under ``shard_map`` on 8 CPU devices, every mix of inputs
that vary between the devices and inputs the same on all of them, run by
test_losses.py in its own process (``--xla_force_host_platform_device_count=8``).

CLIP's and SigLIP's losses per device take the device's embeddings (varying)
with a replicated temperature or bias, or an all-gathered ``y`` (invariant).
Each check differentiates the devices' summed losses with respect to the
global inputs, the blockwise loss inside ``shard_map`` against the plain B x B
formula inside the same ``shard_map`` (JAX's own AD, which sums an invariant
input's cotangent over the devices): value and gradients in float64, within
the losses' float64 claim (1e-12). Prints one JSON object, ``{check name:
{"ok": bool, "detail": str}}``, as the last line of stdout.
"""

import itertools
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
from check_scripts import report
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

NUM_DEVICES, ROWS, DIM = 8, 6, 4  # ROWS per device: blocks of 4, one masked
ARGS = {"softmax": ("x", "y", "scale"), "sigmoid": ("x", "y", "scale", "bias")}
CHECKS = [
    f"{kind}_varying_{'_'.join(varying) or 'none'}"
    for kind, args in ARGS.items()
    for size in range(len(args) + 1)
    for varying in itertools.combinations(args, size)
] + ["softmax_python_float_scale"]


def blockwise(kind, x, y, scale, bias):
    if kind == "softmax":
        return jaxaccum.losses.softmax_contrastive(x, y, scale, block_size=4)
    return jaxaccum.losses.sigmoid_contrastive(x, y, scale, bias, block_size=4)


def formula(kind, x, y, scale, bias):
    """The straightforward formula in JAX (the B x B logits at once)."""
    logits = scale * x @ y.T
    if kind == "softmax":
        diagonal = jnp.diagonal(logits)
        rows = jax.nn.logsumexp(logits, axis=1) - diagonal
        columns = jax.nn.logsumexp(logits, axis=0) - diagonal
        return (jnp.mean(rows) + jnp.mean(columns)) / 2
    labels = 2 * jnp.eye(x.shape[0]) - 1
    return -jnp.sum(jax.nn.log_sigmoid(labels * (logits + bias))) / x.shape[0]


def inputs(varying):
    """Each argument global: NUM_DEVICES slices if it varies, one if not."""
    rng = np.random.default_rng(0)

    def rows(name):
        count = NUM_DEVICES * ROWS if name in varying else ROWS
        embeddings = rng.standard_normal((count, DIM))
        return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)

    def scalar(name, low, high):
        shape = (NUM_DEVICES,) if name in varying else ()
        return rng.uniform(low, high, shape)

    return rows("x"), rows("y"), scalar("scale", 5, 20), scalar("bias", -10, -5)


def summed_over_devices(kind, loss, specs, constant_scale=None):
    """The devices' losses summed, as a function of the global inputs."""

    def per_device(x, y, scale, bias):
        scale = jnp.squeeze(scale) if constant_scale is None else constant_scale
        value = loss(kind, x, y, scale, jnp.squeeze(bias))
        if "data" not in jax.typeof(value).manual_axis_type.varying:
            value = jax.lax.pcast(value, "data", to="varying")
        return jax.lax.psum(value, "data")

    return jax.shard_map(per_device, in_specs=specs, out_specs=P())


def check(kind, varying, constant_scale=None):
    mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
    specs = tuple(P("data") if name in varying else P() for name in ARGS["sigmoid"])
    args = [
        jax.device_put(arg, NamedSharding(mesh, spec))
        for arg, spec in zip(inputs(varying), specs, strict=True)
    ]
    argnums = tuple(range(len(ARGS[kind])))
    with jax.set_mesh(mesh):
        results = [
            jax.jit(
                jax.value_and_grad(
                    summed_over_devices(kind, loss, specs, constant_scale), argnums
                )
            )(*args)
            for loss in (blockwise, formula)
        ]
    chex.assert_trees_all_close(*results, rtol=1e-12, atol=1e-12)
    return f"value {float(results[0][0]):.6f}"


def run(name):
    if name == "softmax_python_float_scale":
        return check("softmax", ("x", "y"), constant_scale=10.0)
    kind, _, varying = name.partition("_varying_")
    return check(kind, () if varying == "none" else tuple(varying.split("_")))


def main():
    jax.config.update("jax_enable_x64", True)
    report(CHECKS, run, NUM_DEVICES)


if __name__ == "__main__":
    sys.exit(main())
