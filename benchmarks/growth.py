"""Growing the batch: when does it pay, and what does the masked step cost?

Four measurements, one run:

1. Smith et al. (2018), "Don't Decay the Learning Rate, Increase the Batch
   Size": on a noisy linear regression with SGD, doubling the batch
   (`jaxaccum.batch_ramp`) at the examples-seen milestones where a step
   schedule would halve the learning rate reaches the same loss after the
   same examples, in fewer steps (each doubling halves the steps of the
   phases after it). Both runs use one masked program
   (`value_and_grad(masked=True)`) and `scale_by_batch_learning_rate`; the
   population loss is exact, so the comparison has no evaluation noise.
2. On a teacher-labelled MLP classifier with Adam (learning rate coupled to
   the batch by the "sqrt" rule), the noise-scale controller
   (`jaxaccum.noise_scale_batch`, its defaults) against fixed windows of
   N = 2 .. 32 micro-batches of 32: examples and steps to a target held-out
   loss. The target was picked on a pilot seed (0) that the evaluation seeds
   (1 .. SEEDS) do not include.
3. The controller's window (N x micro-batch) against its measured noise
   scale (the EMA `noise_scale(state)`) over training: the figure.
4. The masked step's skip cost: a window of M micro-batches with k active
   against the plain step of k micro-batches, in interleaved rounds.

Every run is a jitted `lax.while_loop`: one compile per program, no host
round trip per step.

Run: python benchmarks/growth.py   (a few minutes on 2 cores; writes
benchmarks/results/growth.json and benchmarks/results/growth.png)
"""

import functools
import timeit
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import RESULTS, spread, write_json

import jaxaccum
from jaxaccum.cli import _models

# 1. Smith et al.'s equivalence.
REGRESSION_FEATURES, LABEL_NOISE = 64, 1.0
REGRESSION_MICROBATCH = 8
REGRESSION_LEARNING_RATE = 0.1
MILESTONES = (40_000, 80_000)  # the step schedule halves the learning rate here
TOTAL_EXAMPLES = 120_000
REGRESSION_SEEDS = 64
EQUIVALENCE_TOLERANCE = 0.05

# 2. and 3. The controller against fixed windows.
FEATURES, HIDDEN, CLASSES = 32, 128, 10
MICROBATCH = 32
FIXED_NUM_MICROBATCHES = (2, 4, 8, 16, 32)
ADAM_LEARNING_RATE = 1e-3  # at the base batch, the smallest fixed window
BASE_BATCH = FIXED_NUM_MICROBATCHES[0] * MICROBATCH
TARGET_LOSS = 0.15  # held-out cross-entropy; from the pilot, seed 0
MAX_EXAMPLES = 400_000  # a run that has not reached the target stops here
EVAL_SIZE = 1024
SEEDS = 5
EXAMPLES_AIM, STEPS_AIM = 1.15, 0.7  # controller / smallest fixed window

# 4. The masked step's skip cost.
SKIP_MAX_MICROBATCHES = 8
SKIP_MICROBATCH = 64
ROUNDS = 9
CALLS = 3
SKIP_COST_AIM = 0.02


# 1. Smith et al.'s equivalence ---------------------------------------------

REGRESSION_SCALES = jnp.logspace(0, -1, REGRESSION_FEATURES)
REGRESSION_TEACHER = (
    jax.random.normal(jax.random.key(0), (REGRESSION_FEATURES,)) / REGRESSION_SCALES
)
NOISE_FLOOR = 0.5 * LABEL_NOISE**2


def regression_loss(w, x, y):
    return 0.5 * jnp.mean((x @ w - y) ** 2)


def population_excess_loss(w):
    """The population loss above its floor (label noise), exactly."""
    return 0.5 * jnp.sum((REGRESSION_SCALES * (w - REGRESSION_TEACHER)) ** 2)


def regression_batch(key, size):
    x_key, noise_key = jax.random.split(key)
    x = jax.random.normal(x_key, (size, REGRESSION_FEATURES)) * REGRESSION_SCALES
    noise = LABEL_NOISE * jax.random.normal(noise_key, (size,))
    return x, x @ REGRESSION_TEACHER + noise


def sgd_run(ramp: jaxaccum.BatchRamp, learning_rate, key):
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
    optimizer = jaxaccum.scale_by_batch_learning_rate(
        learning_rate, base_batch=REGRESSION_MICROBATCH, rule="none"
    )
    max_steps = TOTAL_EXAMPLES // REGRESSION_MICROBATCH

    def not_done(carry):
        return carry[2].examples_seen < TOTAL_EXAMPLES

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
            jnp.stack([population_excess_loss(w), ramp_state.examples_seen])
        )
        return w, opt_state, ramp_state, key, step + 1, history

    w = jnp.zeros(REGRESSION_FEATURES)
    history = jnp.full((max_steps, 2), jnp.nan)
    init = (w, optimizer.init(w), ramp.init(), key, 0, history)
    *_, steps, history = jax.lax.while_loop(not_done, sgd_step, init)
    return history, steps


def smith_equivalence() -> dict:
    halve_at = {milestone: 0.5 for milestone in MILESTONES}
    step_schedule = optax.piecewise_constant_schedule(
        REGRESSION_LEARNING_RATE, halve_at
    )
    ramp = jaxaccum.batch_ramp(
        REGRESSION_MICROBATCH,
        {0: 1, **{milestone: 2 ** (i + 1) for i, milestone in enumerate(MILESTONES)}},
    )
    fixed = jaxaccum.batch_ramp(REGRESSION_MICROBATCH, {0: 1})
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


# 2. and 3. The controller against fixed windows ----------------------------

CLASSIFIER_TEACHER = jax.random.normal(jax.random.key(42), (FEATURES, CLASSES))


def classifier_params(key, sizes=(FEATURES, HIDDEN, HIDDEN, CLASSES)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def classifier_loss(params, batch):
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def classifier_batch(key, size):
    x = jax.random.normal(key, (size, FEATURES))
    return {"x": x, "y": jnp.argmax(x @ CLASSIFIER_TEACHER, axis=-1)}


EVAL_BATCH = classifier_batch(jax.random.key(999), EVAL_SIZE)


class TrainCarry(NamedTuple):
    params: Any
    opt_state: Any
    controller_state: Any
    key: jax.Array
    step: jax.Array
    eval_loss: jax.Array
    history: jax.Array  # (max windows, 3): eval loss, window batch, B_noise EMA


@functools.cache
def adam_run(controller: jaxaccum.NoiseScaleBatch):
    """A jitted ``run(seed)``: Adam until the held-out loss reaches TARGET_LOSS
    (or MAX_EXAMPLES), the window sized by ``controller``, masked up to its
    largest size (a fixed window is a controller whose min and max agree)."""
    max_num = controller.max_microbatches
    grad = jaxaccum.value_and_grad(
        classifier_loss, max_num, masked=True, report_stats=True
    )
    optimizer = optax.chain(
        optax.scale_by_adam(),
        jaxaccum.scale_by_batch_learning_rate(ADAM_LEARNING_RATE, BASE_BATCH, "sqrt"),
    )
    max_windows = MAX_EXAMPLES // (controller.min_microbatches * MICROBATCH) + 1

    def not_done(carry: TrainCarry):
        seen = carry.controller_state.examples_seen
        return (carry.eval_loss > TARGET_LOSS) & (seen < MAX_EXAMPLES)

    def adam_step(carry: TrainCarry) -> TrainCarry:
        key, batch_key = jax.random.split(carry.key)
        batch = classifier_batch(batch_key, max_num * MICROBATCH)
        active = carry.controller_state.num_microbatches
        (_, grads), stats = grad(carry.params, batch, active_microbatches=active)
        updates, opt_state = optimizer.update(
            grads, carry.opt_state, carry.params, batch_size=stats.big_batch
        )
        params = optax.apply_updates(carry.params, updates)
        controller_state = controller.update(carry.controller_state, stats)
        eval_loss = classifier_loss(params, EVAL_BATCH)
        window = jnp.stack(
            [eval_loss, stats.big_batch, controller.noise_scale(controller_state)]
        )
        history = carry.history.at[carry.step].set(window)
        return TrainCarry(
            params, opt_state, controller_state, key, carry.step + 1, eval_loss, history
        )

    @jax.jit
    def run(seed):
        params = classifier_params(jax.random.fold_in(jax.random.key(0), seed))
        init = TrainCarry(
            params,
            optimizer.init(params),
            controller.init(),
            jax.random.fold_in(jax.random.key(1), seed),
            jnp.zeros((), jnp.int32),
            jnp.asarray(jnp.inf, jnp.float32),
            jnp.full((max_windows, 3), jnp.nan),
        )
        return jax.lax.while_loop(not_done, adam_step, init)

    return run


def to_target(run: TrainCarry) -> dict:
    steps = int(run.step)
    history = np.asarray(run.history[:steps])
    return {
        "reached": bool(run.eval_loss <= TARGET_LOSS),
        "steps": steps,
        "examples": float(run.controller_state.examples_seen),
        "window_batch": history[:, 1],
        "noise_scale": history[:, 2],
    }


def controller_vs_fixed() -> dict:
    contenders = {
        f"fixed N={num}": jaxaccum.noise_scale_batch(
            MICROBATCH, num, min_microbatches=num
        )
        for num in FIXED_NUM_MICROBATCHES
    }
    contenders["noise_scale_batch"] = jaxaccum.noise_scale_batch(
        MICROBATCH, max(FIXED_NUM_MICROBATCHES)
    )
    runs = {name: [] for name in contenders}
    for seed in range(1, SEEDS + 1):
        for name, controller in contenders.items():
            runs[name].append(to_target(adam_run(controller)(seed)))
            print(f"  seed {seed} {name}: {runs[name][-1]['steps']} steps")
    smallest = runs[f"fixed N={FIXED_NUM_MICROBATCHES[0]}"]
    table = {}
    for name, seeds in runs.items():
        table[name] = {
            "reached_target": all(run["reached"] for run in seeds),
            "examples": spread([run["examples"] for run in seeds]),
            "steps": spread([run["steps"] for run in seeds]),
            # Per seed, against the smallest fixed window of the same seed.
            "examples_ratio": spread(
                [
                    r["examples"] / s["examples"]
                    for r, s in zip(seeds, smallest, strict=True)
                ]
            ),
            "steps_ratio": spread(
                [r["steps"] / s["steps"] for r, s in zip(seeds, smallest, strict=True)]
            ),
        }
    controlled = runs["noise_scale_batch"]
    table["noise_scale_batch"]["window_changes"] = [
        {
            "window": int(change + 1),
            "batch": float(run["window_batch"][change + 1]),
            "noise_scale_ema": float(run["noise_scale"][change]),
        }
        for run in controlled[:1]
        for change in np.flatnonzero(np.diff(run["window_batch"]))
    ]
    return table, controlled


# 4. The masked step's skip cost --------------------------------------------


def skip_cost() -> dict:
    task = _models.mlp_task()
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


def plot(smith_curves, table, controlled, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (smith_axis, sweep_axis, noise_axis) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, curve in smith_curves.items():
        label = name.replace("_", " ") + f" ({len(curve)} steps)"
        smith_axis.plot(curve[:, 1], curve[:, 0], label=label)
    for milestone in MILESTONES:
        smith_axis.axvline(milestone, color="k", lw=0.6, ls=":")
    smith_axis.set(
        yscale="log",
        xlabel="examples seen",
        ylabel="population loss - noise floor",
        title=f"1. SGD: halve the rate or double the batch (median of "
        f"{REGRESSION_SEEDS} seeds)",
    )
    smith_axis.legend(fontsize=8)
    for name, row in table.items():
        marker = "*" if name == "noise_scale_batch" else "o"
        sweep_axis.plot(
            row["steps"]["median"],
            row["examples"]["median"],
            marker,
            markersize=12 if marker == "*" else 7,
            label=name,
        )
    sweep_axis.set(
        xscale="log",
        xlabel="optimizer steps to the target",
        ylabel="examples to the target",
        title=f"2. Adam to held-out loss {TARGET_LOSS} (median of {SEEDS} seeds)",
    )
    sweep_axis.legend(fontsize=8)
    for seed, run in enumerate(controlled, start=1):
        seen = np.cumsum(run["window_batch"])
        noise_axis.plot(
            seen,
            run["noise_scale"],
            color="C0",
            alpha=0.5,
            lw=0.8,
            label="B_noise (EMA)" if seed == 1 else None,
        )
        noise_axis.plot(
            seen,
            run["window_batch"],
            color="C3",
            drawstyle="steps-post",
            label="window N x 32" if seed == 1 else None,
        )
    noise_axis.set(
        yscale="log",
        xlabel="examples seen",
        ylabel="examples",
        title=f"3. noise_scale_batch's window and its B_noise ({SEEDS} seeds)",
    )
    noise_axis.legend(fontsize=8)
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
    print("2. The controller against fixed windows")
    table, controlled = controller_vs_fixed()
    for name, row in table.items():
        print(
            f"  {name}: examples {row['examples']['median']:.0f} "
            f"(x{row['examples_ratio']['median']:.2f}), steps "
            f"{row['steps']['median']:.0f} (x{row['steps_ratio']['median']:.2f})"
        )
    print("4. The masked step's skip cost")
    skip = skip_cost()
    for name, value in skip.items():
        print(f"  {name}: {value}")
    controller = table["noise_scale_batch"]
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
            "controller_vs_fixed": {
                "microbatch_size": MICROBATCH,
                "learning_rate": ADAM_LEARNING_RATE,
                "base_batch": BASE_BATCH,
                "rule": "sqrt",
                "target_loss": TARGET_LOSS,
                "eval_size": EVAL_SIZE,
                "max_examples": MAX_EXAMPLES,
                "seeds": list(range(1, SEEDS + 1)),
                "aims": {"examples_ratio": EXAMPLES_AIM, "steps_ratio": STEPS_AIM},
                "aims_met": {
                    "examples": controller["examples_ratio"]["median"] <= EXAMPLES_AIM,
                    "steps": controller["steps_ratio"]["median"] <= STEPS_AIM,
                },
                "results": table,
            },
            "skip_cost": {"aim": SKIP_COST_AIM, "rounds": ROUNDS, **skip},
        },
    )
    plot(smith_curves, table, controlled, RESULTS / "growth.png")
    print(f"Wrote {path} and {RESULTS / 'growth.png'}")


if __name__ == "__main__":
    main()
