"""Each micro-batch differentiated at its share of the window, against at its
own scale: the low-precision gradients' error against float64.

jaxaccum multiplies a micro-batch's mean loss by ``1 / N`` before its backward
pass (so its cotangents are the big batch's, what FP8's output-gradient amax
needs); before, each micro-batch was differentiated at its own mean and the
sum divided by ``N`` after. This measures what the change does to bfloat16
and float16 gradients (the backward pass in that dtype, float32 master
parameters, float32 accumulation), each against the float64 full-batch
gradient, over SEEDS seeds and N in NUMS: the norm-wise relative error
``|g - g64| / |g64|`` of both, and their ratio (below 1: the share is closer).
The "own scale" contender is ``reduction="sum"`` over the micro-batches' mean
losses, divided by N: exactly what the window did before.

Run: python benchmarks/share.py  (writes benchmarks/results/share.json; about
a minute on 2 CPU cores)
"""

import json
import pathlib

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import jaxaccum  # noqa: E402

SEEDS = 10
NUMS = (3, 8)
BATCH = 240  # divisible by 3 and 8
SIZES = (16, 64, 64, 10)
OUT = pathlib.Path(__file__).parent / "results" / "share.json"


def init(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros(b, jnp.float32),
        }
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def loss_in(dtype):
    def loss(params, batch):
        x = batch["x"].astype(dtype)
        for index, layer in enumerate(params):
            x = x @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
            if index < len(params) - 1:
                x = jnp.tanh(x)
        logits = x.astype(jnp.float32 if dtype != jnp.float64 else dtype)
        labels = jax.nn.one_hot(batch["y"], SIZES[-1], dtype=logits.dtype)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    return loss


def batch_of(key):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (BATCH, SIZES[0]), jnp.float32),
        "y": jax.random.randint(ky, (BATCH,), 0, SIZES[-1]),
    }


def error(grads, reference):
    flat, ref = ravel_pytree(grads)[0], ravel_pytree(reference)[0]
    flat = flat.astype(jnp.float64)
    return float(jnp.linalg.norm(flat - ref) / jnp.linalg.norm(ref))


def gradients(dtype, num, params, batch):
    """(at the share, at the micro-batch's own scale) gradients in ``dtype``."""
    loss = loss_in(dtype)
    options = {}
    scale = {}
    if dtype == jnp.float16:
        options = {"loss_scale": True}
        scale = {"loss_scale": jaxaccum.dynamic_loss_scale()}

    def grads(reduction):
        step = jaxaccum.value_and_grad(loss, num, reduction=reduction, **options)
        out = jax.jit(step)(params, batch, **scale)
        return out[0][1] if options else out[1]  # with a loss scale, (out, report)

    share, own = grads("mean"), grads("sum")
    own = jax.tree.map(lambda g: g / num, own)
    return share, own


def spread(values):
    return {
        "min": float(np.min(values)),
        "median": float(np.median(values)),
        "max": float(np.max(values)),
    }


def main():
    results = {}
    for name, dtype in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
        for num in NUMS:
            errors = {"share": [], "own_scale": []}
            for seed in range(SEEDS):
                params = init(jax.random.key(seed))
                batch = batch_of(jax.random.key(1000 + seed))
                params64 = jax.tree.map(lambda p: p.astype(jnp.float64), params)
                batch64 = {**batch, "x": batch["x"].astype(jnp.float64)}
                reference = jax.grad(loss_in(jnp.float64))(params64, batch64)
                share, own = gradients(dtype, num, params, batch)
                errors["share"].append(error(share, reference))
                errors["own_scale"].append(error(own, reference))
            ratio = np.asarray(errors["share"]) / np.asarray(errors["own_scale"])
            results[f"{name}_N{num}"] = {
                "share_error": spread(errors["share"]),
                "own_scale_error": spread(errors["own_scale"]),
                "ratio": spread(ratio),
            }
            print(name, num, results[f"{name}_N{num}"])
    OUT.write_text(
        json.dumps({"seeds": SEEDS, "batch": BATCH, "results": results}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    main()
