"""FP8 delayed scaling through a window: a short run's loss curve, the big
batch against jaxaccum's window and against the ways a window can get the
metadata wrong.

Flax's ``Fp8DirectDotGeneralOp`` layers (an MLP; every 7th input row 100x the
others, so a window's maxima lie in a few rows) train with SGD on a fixed
regression task, one fresh batch of BATCH rows per step, N micro-batches per
window. Contenders, each from the same initial state and on the same batches:

- ``big batch``: ``jax.value_and_grad`` on the whole batch;
- ``jaxaccum``: ``jaxaccum.value_and_grad(loss, N)`` (metadata maxed, every
  micro-batch differentiated at its share of the window);
- ``averaged``: each micro-batch differentiated at its own mean, every leaf
  (metadata included) averaged: what a window that treats the metadata as
  gradients does (jaxaccum before issue 42);
- ``max, own scale``: the metadata maxed but each micro-batch differentiated
  at its own mean (the fix marin's issue 7659 made): the output-gradient
  history N times the big batch's; consistent with the N-times cotangents it
  scales, so the parameters follow the big batch's here, but the metadata is
  not the big batch's, and changes whenever N or the device count does;
- ``last``: the gradients averaged, the metadata the last micro-batch's.

Recorded per step: the training loss at each contender's variables (the same
function on the same batch; the metadata takes part, since it sets the
forward pass's FP8 scales), each contender's relative distance from the big
batch's parameters, and the largest relative difference of its metadata
(amax histories and scales) from the big batch's. Seeds in SEEDS; the summary
gives min / median / max over them.

Run: python benchmarks/fp8.py  (writes benchmarks/results/fp8.json and
fp8.png; about a minute on 2 CPU cores)
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import RESULTS, spread, write_json
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
from jax.flatten_util import ravel_pytree

import jaxaccum

SEEDS = (0, 1, 2)
STEPS = 150
BATCH, NUM, FEATURES = 64, 4, 16
HISTORY = 16
LEARNING_RATE = 3e-2
CLIP = 1.0
META = fp8_ops.OVERWRITE_WITH_GRADIENT


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        def dense(features):
            return nn.Dense(
                features,
                dot_general_cls=lambda: fp8_ops.Fp8DirectDotGeneralOp(
                    amax_history_length=HISTORY
                ),
            )

        return dense(4)(nn.relu(dense(64)(x)))


MODEL = Mlp()


def loss(variables, batch):
    return jnp.mean((MODEL.apply(variables, batch["x"]) - batch["y"]) ** 2)


def batch_of(key, teacher):
    rows = jnp.where(jnp.arange(BATCH) % 7 == 0, 100.0, 1.0)[:, None]
    x = jax.random.normal(key, (BATCH, FEATURES)) * rows
    return {"x": x, "y": jnp.tanh(x / 10 @ teacher)}


def microbatches(batch):
    return [jax.tree.map(lambda x, k=k: x[k::NUM], batch) for k in range(NUM)]


def per_microbatch(variables, batch):
    """Each micro-batch's gradient of its own mean (what ``averaged``,
    ``max, own scale`` and ``last`` combine)."""
    return [jax.grad(loss)(variables, mb) for mb in microbatches(batch)]


def averaged(variables, batch):
    grads = per_microbatch(variables, batch)
    return jax.tree.map(lambda *g: sum(g) / NUM, *grads)


def maxed_own_scale(variables, batch):
    grads = per_microbatch(variables, batch)
    mean = jax.tree.map(lambda *g: sum(g) / NUM, *grads)
    mean[META] = jax.tree.map(
        lambda *g: jnp.max(jnp.stack(g), 0), *[g[META] for g in grads]
    )
    return mean


def last(variables, batch):
    grads = per_microbatch(variables, batch)
    mean = jax.tree.map(lambda *g: sum(g) / NUM, *grads)
    mean[META] = grads[-1][META]
    return mean


CONTENDERS = {
    "big batch": jax.grad(loss),
    "jaxaccum": jaxaccum.grad(loss, NUM),
    "averaged": averaged,
    "max, own scale": maxed_own_scale,
    "last": last,
}


def run(seed):
    key_init, key_teacher, key_data = jax.random.split(jax.random.key(seed), 3)
    teacher = jax.random.normal(key_teacher, (FEATURES, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = MODEL.init(key_init, jnp.ones((1, FEATURES)))
    start = train_state.TrainState.create(
        apply_fn=MODEL.apply,
        params=variables,
        tx=optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LEARNING_RATE)),
    )
    steps = {
        name: jax.jit(lambda s, b, g=grad: s.apply_gradients(grads=g(s.params, b)))
        for name, grad in CONTENDERS.items()
    }
    evaluate = jax.jit(loss)
    states = dict.fromkeys(CONTENDERS, start)
    curves = {name: [] for name in CONTENDERS}
    distance = {name: [] for name in CONTENDERS}
    metadata = {name: [] for name in CONTENDERS}
    for step in range(STEPS):
        batch = batch_of(jax.random.fold_in(key_data, step), teacher)
        states = {name: steps[name](states[name], batch) for name in CONTENDERS}
        big = ravel_pytree(states["big batch"].params["params"])[0]
        for name, state in states.items():
            curves[name].append(float(evaluate(state.params, batch)))
            flat = ravel_pytree(state.params["params"])[0]
            distance[name].append(
                float(jnp.linalg.norm(flat - big) / jnp.linalg.norm(big))
            )
            metadata[name].append(
                metadata_gap(state.params[META], states["big batch"].params[META])
            )
    return {"loss": curves, "distance": distance, "metadata": metadata}


def metadata_gap(mine, big):
    """The largest relative difference over the metadata's leaves."""
    gaps = jax.tree.map(
        lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30),
        mine,
        big,
    )
    return float(max(jax.tree.leaves(gaps)))


def weighted_loss(variables, batch):
    """The token-weighted loss: (sum of weighted squared errors, total weight)."""
    per_row = jnp.mean((MODEL.apply(variables, batch["x"]) - batch["y"]) ** 2, -1)
    return jnp.sum(per_row * batch["w"]), jnp.sum(batch["w"])


def weighted_gaps(seed):
    """The first step's gradient under ``reduction="weighted"`` against the
    big batch's weighted mean: the largest relative gap of the parameters'
    gradients and of the output-gradient amax histories, for weights equal
    over the micro-batches (each the same blocks of 1, 2, 3) and unequal
    (1, 2, 3 by row: micro-batch totals 31 to 33); and the workaround where
    the total is known before the pass, the loss divided by it, summed."""
    key_init, key_teacher, key_data = jax.random.split(jax.random.key(seed), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = MODEL.init(key_init, jnp.ones((1, FEATURES)))
    batch = batch_of(key_data, jax.random.normal(key_teacher, (FEATURES, 4)))
    rows = jnp.arange(BATCH)
    weights = {"equal": 1.0 + (rows // NUM) % 3, "unequal": 1.0 + rows % 3}

    def big(v, b):
        total, weight = weighted_loss(v, b)
        return total / weight

    out = {}
    for name, w in weights.items():
        b = {**batch, "w": w}
        expected = jax.grad(big)(variables, b)
        window = jaxaccum.grad(weighted_loss, NUM, reduction="weighted")
        out[name] = gradient_gaps(jax.jit(window)(variables, b), expected)
        if name == "unequal":
            total = jnp.sum(w)
            known = jaxaccum.grad(
                lambda v, mb, total=total: weighted_loss(v, mb)[0] / total,
                NUM,
                reduction="sum",
            )
            out["unequal_total_known"] = gradient_gaps(
                jax.jit(known)(variables, b), expected
            )
    return out


def gradient_gaps(grads, expected):
    """Relative gaps of the parameters' gradients and of the output-gradient
    amax histories (the metadata the cotangents set)."""

    def output_grad(tree):
        return {
            jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree[META])
            if "output_grad" in jax.tree_util.keystr(path)
        }

    return {
        "gradient_gap": metadata_gap(grads["params"], expected["params"]),
        "output_grad_amax_gap": metadata_gap(output_grad(grads), output_grad(expected)),
    }


def summary(runs):
    out = {}
    for name in CONTENDERS:
        final = [r["loss"][name][-1] / r["loss"]["big batch"][-1] for r in runs]
        out[name] = {
            "final_loss_ratio": spread(final),
            "max_param_distance": spread([max(r["distance"][name]) for r in runs]),
            "max_metadata_gap": spread([max(r["metadata"][name]) for r in runs]),
        }
    return out


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {
        "jaxaccum": ("tab:green", "--", 2.0),
        "averaged": ("tab:blue", "-", 1.0),
        "max, own scale": ("tab:orange", ":", 1.5),
        "last": ("tab:red", "-", 1.0),
    }
    big = np.asarray(runs[0]["loss"]["big batch"])
    for name, (color, line, width) in styles.items():
        style = {"label": name, "color": color, "ls": line, "lw": width}
        left.plot(np.asarray(runs[0]["loss"][name]) / big, **style)
        right.semilogy(np.maximum(runs[0]["distance"][name], 1e-9), **style)
    left.set(xlabel="optimizer step", ylabel="loss / the big batch's loss")
    right.set(xlabel="optimizer step", ylabel="|params - big batch's| / |big batch's|")
    left.legend()
    left.set_title(f"FP8 MLP, N={NUM} micro-batches of {BATCH // NUM}, seed {SEEDS[0]}")
    right.set_title("distance from the big batch's training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    runs = [run(seed) for seed in SEEDS]
    weighted = [weighted_gaps(seed) for seed in SEEDS]
    result = {
        "config": {
            "steps": STEPS,
            "batch": BATCH,
            "num_microbatches": NUM,
            "seeds": list(SEEDS),
            "learning_rate": LEARNING_RATE,
            "clip_by_global_norm": CLIP,
            "history": HISTORY,
        },
        "results": summary(runs),
        "weighted": {
            case: {
                gap: spread([w[case][gap] for w in weighted])
                for gap in weighted[0][case]
            }
            for case in weighted[0]
        },
        "curves_first_seed": runs[0],
    }
    write_json("fp8", result)
    plot(runs, RESULTS / "fp8.png")
    print(json.dumps({k: result[k] for k in ("results", "weighted")}, indent=1))


if __name__ == "__main__":
    main()
