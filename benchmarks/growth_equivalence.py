"""Growing the batch with a fixed ramp, and what the masked step costs.

1. Smith et al. (2018), "Don't Decay the Learning Rate, Increase the Batch
   Size": on a noisy linear regression with SGD, doubling the batch
   (`jaxaccum.growth.BatchRamp`) at the examples-seen milestones where a step
   schedule would halve the learning rate reaches the same loss after the
   same examples, in fewer steps (each doubling halves the steps of the
   phases after it). Both runs use one masked program
   (`value_and_grad(masked=True)`) and `scale_by_batch_learning_rate`; the
   population loss is exact, so the comparison has no evaluation noise.
2. The masked step's skip cost: a window of M micro-batches with k active
   against the plain step of k micro-batches, in interleaved rounds.

Run: ``python benchmarks/growth.py`` (under a minute on 2 cores; writes
benchmarks/results/growth.json and growth.png).
"""

import functools
import timeit

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import RESULTS, spread, write_json

import jaxaccum
import jaxaccum.growth
from jaxaccum.cli import models

# 1. Smith et al.'s equivalence.
REGRESSION_FEATURES, LABEL_NOISE = 64, 1.0
REGRESSION_MICROBATCH = 8
REGRESSION_LEARNING_RATE = 0.1
MILESTONES = (40_000, 80_000)  # the step schedule halves the learning rate here
TOTAL_EXAMPLES = 120_000
REGRESSION_SEEDS = 64
EQUIVALENCE_TOLERANCE = 0.05
NOISE_FLOOR = 0.5 * LABEL_NOISE**2

# 2. The masked step's skip cost.
SKIP_MAX_MICROBATCHES = 8
SKIP_MICROBATCH = 64
ROUNDS = 9
CALLS = 3
SKIP_COST_AIM = 0.02


# 1. Smith et al.'s equivalence ---------------------------------------------


@functools.cache
def regression_problem() -> tuple[jax.Array, jax.Array]:
    """The inputs' scales (curvatures 1 to 0.01) and the teacher, built on
    first use (a constant, even if first asked inside jit)."""
    with jax.ensure_compile_time_eval():
        scales = jnp.logspace(0, -1, REGRESSION_FEATURES)
        teacher = jax.random.normal(jax.random.key(0), (REGRESSION_FEATURES,))
        return scales, teacher / scales


def regression_loss(w, x, y):
    return 0.5 * jnp.mean((x @ w - y) ** 2)


def population_excess_loss(w):
    """The population loss above its floor (label noise), exactly."""
    scales, teacher = regression_problem()
    return 0.5 * jnp.sum((scales * (w - teacher)) ** 2)


def regression_batch(key, size):
    scales, teacher = regression_problem()
    x_key, noise_key = jax.random.split(key)
    x = jax.random.normal(x_key, (size, REGRESSION_FEATURES)) * scales
    noise = LABEL_NOISE * jax.random.normal(noise_key, (size,))
    return x, x @ teacher + noise


def sgd_run(ramp: jaxaccum.growth.BatchSizeController, learning_rate, key):
    """SGD from 0 until TOTAL_EXAMPLES, the window sized by ``ramp``: the
    excess loss and the examples seen after every window, and the steps."""
    max_num = max(ramp.possible_num_microbatches)
    # One program for every window size; micro-batch k of the window is rows
    # k, k + max_num, ... of fresh i.i.d. rows, so drawing max_num micro-batches
    # and skipping the inactive ones is pad_microbatches without the copy.
    grad = jaxaccum.value_and_grad(
        regression_loss,
        max_num,
        batch_argnums=(1, 2),
        masked=True,
        report_stats=True,
    )
    optimizer = jaxaccum.growth.scale_by_batch_learning_rate(
        learning_rate, base_batch=REGRESSION_MICROBATCH, rule="none"
    )
    max_steps = TOTAL_EXAMPLES // REGRESSION_MICROBATCH

    def not_done(carry):
        return carry[2].examples_seen.total < TOTAL_EXAMPLES

    def sgd_step(carry):
        w, opt_state, ramp_state, key, step, history = carry
        key, batch_key = jax.random.split(key)
        batch = regression_batch(batch_key, max_num * REGRESSION_MICROBATCH)
        (_, grads), stats = grad(
            w, *batch, active_microbatches=ramp_state.num_microbatches
        )
        updates, opt_state = optimizer.update(
            grads, opt_state, batch_size=stats.big_batch
        )
        w = optax.apply_updates(w, updates)
        ramp_state = ramp.update(ramp_state, stats)
        history = history.at[step].set(
            jnp.stack([population_excess_loss(w), ramp_state.examples_seen.total])
        )
        return w, opt_state, ramp_state, key, step + 1, history

    w = jnp.zeros(REGRESSION_FEATURES)
    history = jnp.full((max_steps, 2), jnp.nan)
    init = (w, optimizer.init(w), ramp.init(), key, 0, history)
    *_, steps, history = jax.lax.while_loop(not_done, sgd_step, init)
    return history, steps


def smith_equivalence() -> tuple[dict, dict, jaxaccum.growth.BatchRamp]:
    halve_at = {milestone: 0.5 for milestone in MILESTONES}
    step_schedule = optax.piecewise_constant_schedule(
        REGRESSION_LEARNING_RATE, halve_at
    )
    ramp = jaxaccum.growth.BatchRamp(
        REGRESSION_MICROBATCH,
        {0: 1, **{milestone: 2 ** (i + 1) for i, milestone in enumerate(MILESTONES)}},
    )
    fixed = jaxaccum.growth.BatchRamp(REGRESSION_MICROBATCH, {0: 1})
    keys = jax.random.split(jax.random.key(1), REGRESSION_SEEDS)
    runs = {
        "decay_learning_rate": (fixed, step_schedule),
        "increase_batch": (ramp, REGRESSION_LEARNING_RATE),
    }
    bounds = (0, *MILESTONES, TOTAL_EXAMPLES)
    predicted_steps = sum(
        (end - start) // (REGRESSION_MICROBATCH * 2**phase)
        for phase, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    )
    result = {
        "predicted_steps": {
            "decay_learning_rate": TOTAL_EXAMPLES // REGRESSION_MICROBATCH,
            "increase_batch": predicted_steps,
        }
    }
    curves = {}
    for name, (controller, learning_rate) in runs.items():
        run = jax.jit(jax.vmap(functools.partial(sgd_run, controller, learning_rate)))
        history, steps = jax.device_get(run(keys))
        final = [
            float(run[step - 1, 0]) for run, step in zip(history, steps, strict=True)
        ]
        result[name] = {
            "steps": sorted({int(step) for step in steps}),
            "final_excess_loss": spread(final),
            "final_loss": spread([NOISE_FLOOR + loss for loss in final]),
        }
        curves[name] = np.median(history[:, : int(steps[0])], axis=0)
    ratio = (
        result["increase_batch"]["final_excess_loss"]["median"]
        / result["decay_learning_rate"]["final_excess_loss"]["median"]
    )
    result["excess_loss_ratio"] = ratio
    result["equivalent"] = abs(ratio - 1) <= EQUIVALENCE_TOLERANCE and all(
        result[name]["steps"] == [result["predicted_steps"][name]] for name in runs
    )
    return result, curves, ramp


# 2. The masked step's skip cost --------------------------------------------


def skip_cost() -> dict:
    task = models.mlp_task()
    max_num = SKIP_MAX_MICROBATCHES
    actives = (1, max_num // 2, max_num)
    masked = jax.jit(jaxaccum.value_and_grad(task.loss, max_num, masked=True))
    plain = {
        num: jax.jit(jaxaccum.value_and_grad(task.loss, num))
        for num in sorted({1, *actives})
    }
    full = task.make_batch(jax.random.key(0), max_num * SKIP_MICROBATCH)
    calls = {}
    for num in actives:
        batch = jax.tree.map(lambda x, rows=num * SKIP_MICROBATCH: x[:rows], full)
        padded = jaxaccum.pad_microbatches(batch, num, max_num)
        calls[f"masked k={num}"] = functools.partial(
            masked, task.params, padded, active_microbatches=num
        )
        calls[f"plain N={num}"] = functools.partial(plain[num], task.params, batch)
    seconds = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():

            def blocked(call=call):
                jax.block_until_ready(call())

            blocked()
            seconds[name].append(min(timeit.repeat(blocked, number=1, repeat=CALLS)))
    per_round = [
        dict(zip(seconds, times, strict=True))
        for times in zip(*seconds.values(), strict=True)
    ]
    result = {
        "microbatch_size": SKIP_MICROBATCH,
        "max_microbatches": max_num,
        "window_ms": {
            name: spread([t * 1e3 for t in s]) for name, s in seconds.items()
        },
    }
    for num in actives[:-1]:
        ratios = [
            (t[f"masked k={num}"] - t[f"plain N={num}"])
            / (max_num - num)
            / ((t[f"plain N={max_num}"] - t["plain N=1"]) / (max_num - 1))
            for t in per_round
        ]
        result[f"skipped_over_computed k={num}"] = spread(ratios)
    result["masked_over_plain k=M"] = spread(
        [t[f"masked k={max_num}"] / t[f"plain N={max_num}"] for t in per_round]
    )
    return result


# The figure and the report --------------------------------------------------


def plot(smith_curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, curve in smith_curves.items():
        label = name.replace("_", " ") + f" ({len(curve)} steps)"
        axis.plot(curve[:, 1], curve[:, 0], label=label)
    for milestone in MILESTONES:
        axis.axvline(milestone, color="k", lw=0.6, ls=":")
    axis.set(
        yscale="log",
        xlabel="examples seen",
        ylabel="population loss - noise floor",
        title=f"SGD: halve the rate or double the batch (median of "
        f"{REGRESSION_SEEDS} seeds)",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    print("1. Smith et al.'s equivalence")
    smith, smith_curves, ramp = smith_equivalence()
    for name in ("decay_learning_rate", "increase_batch"):
        row = smith[name]
        print(
            f"  {name}: {row['steps']} steps (predicted "
            f"{smith['predicted_steps'][name]}), final loss median "
            f"{row['final_loss']['median']:.5f}, excess "
            f"{row['final_excess_loss']['median']:.5f}"
        )
    print(f"  excess loss ratio {smith['excess_loss_ratio']:.3f}")
    print("2. The masked step's skip cost")
    skip = skip_cost()
    for name, value in skip.items():
        print(f"  {name}: {value}")
    path = write_json(
        "growth",
        {
            "smith_equivalence": {
                "features": REGRESSION_FEATURES,
                "label_noise": LABEL_NOISE,
                "microbatch_size": REGRESSION_MICROBATCH,
                "learning_rate": REGRESSION_LEARNING_RATE,
                "milestones": MILESTONES,
                "total_examples": TOTAL_EXAMPLES,
                "ramp": dict(ramp.schedule),
                "seeds": REGRESSION_SEEDS,
                **smith,
            },
            "skip_cost": {"aim": SKIP_COST_AIM, "rounds": ROUNDS, **skip},
        },
    )
    plot(smith_curves, RESULTS / "growth.png")
    print(f"Wrote {path} and {RESULTS / 'growth.png'}")
