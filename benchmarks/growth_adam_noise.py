"""Why the noise-scale controller misses at c=64 on the MLP: would the noise
scale of Adam's preconditioned gradient move it? The noise scale of Adam's
preconditioned gradient against the raw one, from per-example gradients along
fixed-window runs of growth_tasks.py's MLP classifier.

Run: ``python benchmarks/growth.py adam-noise`` (about 4 minutes; writes
benchmarks/results/growth_adam_noise.json).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import spread, write_json
from growth_tasks import (
    ADAM_B2,
    ADAM_EPS,
    ADAM_LEARNING_RATE,
    COST_SEEDS,
    MAX_EXAMPLES,
    MICROBATCH,
    TARGET_LOSS,
    classifier_batch,
    classifier_eval_batch,
    classifier_loss,
    classifier_params,
    sweep_optimizer,
)
from jax.flatten_util import ravel_pytree

ADAM_NOISE_EVERY = 16_384  # examples between measurements
ADAM_NOISE_EXAMPLES = 4096  # per-example gradients per measurement


def adam_noise_scales(params, adam_state, key) -> jax.Array:
    """The MLP's noise scale at ``params`` from per-example gradients: raw,
    ``tr(S)/|G|^2``; and preconditioned by Adam's bias-corrected second
    moments, ``P = 1/(sqrt(nu_hat) + eps)`` (sweep_optimizer's), with the
    curvature taken as the identity, ``tr(P S P)/|P G|^2``, or as ``1/P``,
    ``tr(P S)/(G' P G)`` (McCandlish et al., appendix on preconditioning)."""
    batch = classifier_batch(key, ADAM_NOISE_EXAMPLES)
    rows = jax.tree.map(lambda x: x[:, None], batch)
    per_example = jax.vmap(jax.grad(classifier_loss), in_axes=(None, 0))(params, rows)
    flat = jax.vmap(lambda grads: ravel_pytree(grads)[0])(per_example)
    mean, variance = flat.mean(0), flat.var(0, ddof=1)
    nu_hat = ravel_pytree(adam_state.nu)[0] / (1 - ADAM_B2**adam_state.count)
    precondition = 1 / (jnp.sqrt(nu_hat) + ADAM_EPS)
    return jnp.stack(
        [
            variance.sum() / (mean @ mean),
            (precondition**2 * variance).sum() / jnp.sum((precondition * mean) ** 2),
            (precondition * variance).sum() / (mean @ (precondition * mean)),
        ]
    )


def adam_noise(num: int, seed: int) -> list:
    """Fixed windows of ``num`` micro-batches on the MLP, the cost sweep's
    optimizer; the three noise scales every ADAM_NOISE_EVERY examples until
    the target: ``[examples seen, raw, P-I, P-H]`` rows."""
    batch_size = num * MICROBATCH
    optimizer = sweep_optimizer(ADAM_LEARNING_RATE, "sqrt")

    @jax.jit
    def step(params, opt_state, key):
        grads = jax.grad(classifier_loss)(params, classifier_batch(key, batch_size))
        updates, opt_state = optimizer.update(
            grads, opt_state, params, batch_size=batch_size
        )
        return optax.apply_updates(params, updates), opt_state

    params = classifier_params(jax.random.fold_in(jax.random.key(0), seed))
    opt_state, key, rows = optimizer.init(params), jax.random.key(seed), []
    measure = jax.jit(adam_noise_scales)
    for window in range(MAX_EXAMPLES // batch_size):
        key, step_key, noise_key = jax.random.split(key, 3)
        params, opt_state = step(params, opt_state, step_key)
        seen = (window + 1) * batch_size
        if seen % ADAM_NOISE_EVERY < batch_size:
            scales = measure(params, opt_state[0], noise_key)
            rows.append([seen, *np.asarray(scales).tolist()])
            if classifier_loss(params, classifier_eval_batch()) <= TARGET_LOSS:
                break
    return rows


def main() -> None:
    runs = {
        f"fixed N={num}": {seed: adam_noise(num, seed) for seed in COST_SEEDS}
        for num in (8, 16)
    }
    rows = [row for seeds in runs.values() for run in seeds.values() for row in run]
    names = ("raw", "preconditioned P-I", "preconditioned P-H")
    summary = {
        name: spread([row[column] for row in rows])
        for column, name in enumerate(names, start=1)
    }
    summary["P-I / raw"] = spread([row[2] / row[1] for row in rows])
    summary["P-H / raw"] = spread([row[3] / row[1] for row in rows])
    print(summary)
    path = write_json(
        "growth_adam_noise",
        {
            "task": "mlp classifier",
            "seeds": list(COST_SEEDS),
            "every_examples": ADAM_NOISE_EVERY,
            "per_example_gradients": ADAM_NOISE_EXAMPLES,
            "columns": ["examples seen", *names],
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"Wrote {path}")
