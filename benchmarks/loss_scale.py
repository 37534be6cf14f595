"""Float16 loss scaling under accumulation: a scale per window against a scale
per micro-batch, a static scale, and none.

The task: a 16-64-64-10 tanh MLP learning a teacher network's labels, float32
master parameters and float16 activations (the forward and backward passes in
float16, the loss's mean in float32), Adam, windows of N = 8 micro-batches of
32 examples. The loss is the cross-entropy times 2**-20 (a loss normalised by
a fixed large token budget, say): unscaled, every gradient of the float16
backward pass falls below float16's smallest subnormal (6e-8) and is zero.

Contenders, each fed the same stream of micro-batches (one call per
micro-batch; WINDOWS * N calls):

- ``float32``: the reference, float32 throughout, ``jaxaccum.MultiSteps``.
- ``float16_unscaled``: float16 activations, no loss scale.
- ``jaxaccum_window``: ``jaxaccum.MultiSteps(..., loss_scale=...)``: the scale
  held for the window, a window with an overflow skipped whole, growth after
  PERIOD finite windows.
- ``jaxaccum_in_step``: the same rule in one step per window,
  ``jaxaccum.value_and_grad(..., loss_scale=True)`` and
  ``jaxaccum.select_if_finite``.
- ``flax_per_microbatch``: ``flax.training.dynamic_scale.DynamicScale`` used
  per micro-batch (its ``value_and_grad`` adjusts the scale on every call),
  growth after PERIOD finite calls, its non-finite micro-batches dropped by
  ``optax.MultiSteps(should_skip_update_fn=optax.skip_not_finite)``; and
  ``flax_per_microbatch_slow``, growth after PERIOD * N calls (the same time
  constant as one per PERIOD windows). Keras 3's LossScaleOptimizer around an
  optimizer with gradient_accumulation_steps behaves like these (checked per
  micro-batch, the overflowing one dropped, the scale halved mid-window).
- ``optax_static``: a fixed scale, ``optax.MultiSteps(should_skip_update_fn=
  optax.skip_not_finite)``: non-finite micro-batches dropped, nothing lowers
  the scale.

Every dynamic rule starts at INITIAL_SCALE = 2**15 (jmp's and Keras' default),
factor 2, floor 1. Recorded per window: the held-out loss (the cross-entropy,
float32) and the scale; per contender: optimizer steps taken, windows skipped,
micro-batches dropped, windows whose scale changed mid-window. One run,
deterministic data; about a minute on 2 CPU cores.

Run: python benchmarks/loss_scale.py  (writes benchmarks/results/loss_scale.json
and loss_scale.png)
"""

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import RESULTS, write_json
from flax.training.dynamic_scale import DynamicScale

import jaxaccum

SIZES = (16, 64, 64, 10)
TEACHER_SIZES = (16, 32, 10)
NUM_MICROBATCHES, MICROBATCH_SIZE = 8, 32
WINDOWS = 400
LOSS_WEIGHT = 2.0**-20
LEARNING_RATE = 3e-3
INITIAL_SCALE, PERIOD, FACTOR, FLOOR = 2.0**15, 10, 2.0, 1.0
EVAL_SIZE = 2048
FINAL_WINDOWS = 20  # the final loss: the mean over the last windows' losses


def mlp_params(key: jax.Array, sizes: tuple[int, ...]) -> list:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_apply(params: list, x: jax.Array, dtype: Any) -> jax.Array:
    """Logits in float32 from activations in ``dtype``."""
    h = x.astype(dtype)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h.astype(jnp.float32)


TEACHER = mlp_params(jax.random.key(1), TEACHER_SIZES)


def make_batch(key: jax.Array, size: int) -> dict:
    x = jax.random.normal(key, (size, SIZES[0]))
    return {"x": x, "y": jnp.argmax(mlp_apply(TEACHER, x, jnp.float32) * 3, -1)}


def cross_entropy(params: list, batch: dict, dtype: Any) -> jax.Array:
    logits = mlp_apply(params, batch["x"], dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train_loss(dtype: Any) -> Callable[[list, dict], jax.Array]:
    def loss(params: list, batch: dict) -> jax.Array:
        return LOSS_WEIGHT * cross_entropy(params, batch, dtype)

    return loss


def micro_batch(call: int) -> dict:
    return make_batch(jax.random.fold_in(jax.random.key(2), call), MICROBATCH_SIZE)


def adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


# --- Contenders: each returns (init, call) ------------------------------------
# call(carry, batch) -> (carry, record); the carry holds params first.


def call_record(scale: Any, state: Any, dropped: jax.Array) -> dict:
    """What a call did: the scale it used, the optimizer steps so far,
    whether it closed a window (applied or skipped) or was dropped."""
    return {
        "scale": jnp.float32(scale),
        "steps": state.gradient_step,
        "closed": (state.mini_step == 0) & ~dropped,
        "dropped": dropped,
    }


def multisteps_contender(dtype: Any, loss_scale: Any = None) -> tuple:
    """jaxaccum.MultiSteps, optionally with the scale held for the window."""
    optimizer = jaxaccum.MultiSteps(adam(), NUM_MICROBATCHES, loss_scale=loss_scale)
    loss = train_loss(dtype)

    @jax.jit
    def call(carry, batch):
        params, state = carry
        scale = 1.0 if loss_scale is None else optimizer.loss_scale(state)
        grads = jax.grad(lambda p: scale * loss(p, batch))(params)
        updates, state = optimizer.update(grads, state, params)
        record = call_record(scale, state, jnp.bool_(False))
        return (optax.apply_updates(params, updates), state), record

    return (lambda params: (params, optimizer.init(params))), call


def flax_contender(growth_interval: int) -> tuple:
    """Flax's DynamicScale per micro-batch, optax.MultiSteps dropping the
    micro-batches it finds not finite."""
    optimizer = optax.MultiSteps(
        adam(), NUM_MICROBATCHES, should_skip_update_fn=optax.skip_not_finite
    )
    grad_fn_of = train_loss(jnp.float16)

    @jax.jit
    def call(carry, batch):
        params, state, dynamic_scale = carry
        scale = dynamic_scale.scale
        dynamic_scale, finite, _, grads = dynamic_scale.value_and_grad(grad_fn_of)(
            params, batch
        )
        updates, state = optimizer.update(grads, state, params)
        record = call_record(scale, state, ~finite)
        return (optax.apply_updates(params, updates), state, dynamic_scale), record

    def init(params):
        dynamic_scale = DynamicScale(
            growth_interval=growth_interval,
            scale=INITIAL_SCALE,
            minimum_scale=FLOOR,
            growth_factor=FACTOR,
            backoff_factor=1 / FACTOR,
        )
        return params, optimizer.init(params), dynamic_scale

    return init, call


def static_contender(scale: float) -> tuple:
    """A fixed scale; optax.MultiSteps drops the non-finite micro-batches."""
    optimizer = optax.MultiSteps(
        adam(), NUM_MICROBATCHES, should_skip_update_fn=optax.skip_not_finite
    )
    loss = train_loss(jnp.float16)

    @jax.jit
    def call(carry, batch):
        params, state = carry
        grads = jax.grad(lambda p: scale * loss(p, batch))(params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, state = optimizer.update(grads, state, params)
        record = call_record(scale, state, state.skip_state["should_skip"])
        return (optax.apply_updates(params, updates), state), record

    return (lambda params: (params, optimizer.init(params))), call


def run_calls(contender: tuple, params: list, evaluate: Callable) -> dict:
    """WINDOWS * N calls; the held-out loss and the scale after every N."""
    init, call = contender
    carry = init(params)
    records, losses = [], []
    for index in range(WINDOWS * NUM_MICROBATCHES):
        carry, record = call(carry, micro_batch(index))
        records.append(jax.device_get(record))
        if (index + 1) % NUM_MICROBATCHES == 0:
            losses.append(float(evaluate(carry[0])))
    return summarise(records, losses)


def run_in_step(params: list, evaluate: Callable) -> dict:
    """The per-window rule in one step a window (value_and_grad + select)."""
    optimizer = adam()
    accumulated = jaxaccum.value_and_grad(
        train_loss(jnp.float16), NUM_MICROBATCHES, loss_scale=True
    )

    @jax.jit
    def window_step(params, opt_state, scale, batch):
        (_, grads), report = accumulated(params, batch, loss_scale=scale)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jaxaccum.select_if_finite(
            report.finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, report

    opt_state = optimizer.init(params)
    scale = jaxaccum.dynamic_loss_scale(
        INITIAL_SCALE, period=PERIOD, factor=FACTOR, min_loss_scale=FLOOR
    )
    records, losses, steps = [], [], 0
    for window in range(WINDOWS):
        calls = range(window * NUM_MICROBATCHES, (window + 1) * NUM_MICROBATCHES)
        # Micro-batch k of the strided split is micro-batch k of the stream.
        batch = jax.tree.map(
            lambda *rows: jnp.stack(rows, 1).reshape(-1, *rows[0].shape[1:]),
            *(micro_batch(call) for call in calls),
        )
        window_scale = scale.loss_scale
        params, opt_state, report = window_step(params, opt_state, scale, batch)
        scale = report.loss_scale
        for k in range(NUM_MICROBATCHES):
            last = k == NUM_MICROBATCHES - 1
            steps += last and bool(report.finite)
            records.append(
                {
                    "scale": window_scale,
                    "steps": steps,
                    "closed": last,
                    "dropped": False,
                }
            )
        losses.append(float(evaluate(params)))
    return summarise(records, losses)


def summarise(records: list[dict], losses: list[float]) -> dict:
    """Counts over the calls, per window of N calls of the stream."""
    scales = np.array([float(r["scale"]) for r in records])
    by_window = scales.reshape(WINDOWS, NUM_MICROBATCHES)
    steps = int(records[-1]["steps"])
    closed = sum(bool(r["closed"]) for r in records)
    dropped = sum(bool(r["dropped"]) for r in records)
    # Steps whose window averaged other examples than the loader's window:
    # a micro-batch was dropped since the previous step.
    altered, dropped_since_step, previous, first = 0, False, 0, None
    for call, record in enumerate(records):
        stepped = int(record["steps"]) > previous
        skipped = bool(record["closed"]) and not stepped
        if first is None and (skipped or bool(record["dropped"])):
            first = call // NUM_MICROBATCHES + 1  # 1-based, as plotted
        dropped_since_step |= bool(record["dropped"])
        if stepped:
            altered += dropped_since_step
            dropped_since_step, previous = False, int(record["steps"])
    return {
        "final_loss": float(np.mean(losses[-FINAL_WINDOWS:])),
        "optimizer_steps": steps,
        "windows_skipped": closed - steps,
        "microbatches_dropped": dropped,
        "microbatches_unused": (closed - steps) * NUM_MICROBATCHES + dropped,
        "steps_with_dropped_microbatch": altered,
        "first_unused_window": first,  # None: every micro-batch was used
        "windows_with_scale_change": int(
            np.sum(by_window.min(axis=1) != by_window.max(axis=1))
        ),
        "final_log2_scale": float(np.log2(scales[-1])),
        "max_log2_scale": float(np.log2(scales.max())),
        "loss": losses,
        "log2_scale": [float(x) for x in np.log2(by_window[:, -1])],
    }


def plot(results: dict, path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axes, ratio_axes, scale_axes) = plt.subplots(1, 3, figsize=(18, 5))
    windows = np.arange(1, WINDOWS + 1)
    reference = np.asarray(results["float32"]["loss"])
    colors = dict(zip(results, plt.get_cmap("tab10").colors, strict=False))
    for name, result in results.items():
        style = {
            "ls": "--" if name == "jaxaccum_in_step" else "-",
            "lw": 1.2,
            "color": colors[name],
        }
        loss_axes.plot(windows, result["loss"], label=name, **style)
        if name != "float16_unscaled":
            ratio_axes.plot(windows, result["loss"] / reference, label=name, **style)
        if name not in ("float32", "float16_unscaled"):
            scale_axes.plot(windows, result["log2_scale"], label=name, **style)
    loss_axes.set(
        xlabel=f"window of the stream ({NUM_MICROBATCHES} micro-batches of "
        f"{MICROBATCH_SIZE})",
        ylabel="held-out cross-entropy",
        yscale="log",
        title="Loss (float16 activations)",
    )
    ratio_axes.set(
        xlabel="window of the stream",
        ylabel="loss / float32 run's loss",
        title="Loss relative to float32 (unscaled float16 off the chart)",
    )
    scale_axes.set(
        xlabel="window of the stream",
        ylabel="log2 loss scale (after the window's last call)",
        title="Loss scale",
    )
    for axes in (loss_axes, ratio_axes, scale_axes):
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    params = mlp_params(jax.random.key(0), SIZES)
    eval_batch = make_batch(jax.random.key(3), EVAL_SIZE)
    evaluate = jax.jit(lambda p: cross_entropy(p, eval_batch, jnp.float32))
    initial = jaxaccum.dynamic_loss_scale(
        INITIAL_SCALE, period=PERIOD, factor=FACTOR, min_loss_scale=FLOOR
    )
    contenders = {
        "float32": multisteps_contender(jnp.float32),
        "float16_unscaled": multisteps_contender(jnp.float16),
        "jaxaccum_window": multisteps_contender(jnp.float16, initial),
        "flax_per_microbatch": flax_contender(PERIOD),
        "flax_per_microbatch_slow": flax_contender(PERIOD * NUM_MICROBATCHES),
        "optax_static": static_contender(INITIAL_SCALE),
    }
    results, seconds = {}, {}
    for name, contender in contenders.items():
        start = time.perf_counter()
        results[name] = run_calls(contender, params, evaluate)
        seconds[name] = time.perf_counter() - start
    start = time.perf_counter()
    results["jaxaccum_in_step"] = run_in_step(params, evaluate)
    seconds["jaxaccum_in_step"] = time.perf_counter() - start
    reference = results["float32"]
    for name, result in results.items():
        result["final_loss_vs_float32"] = result["final_loss"] / reference["final_loss"]
        # Float32 after as many optimizer steps (a window is a step there).
        steps = result["optimizer_steps"]
        at_steps = np.mean(reference["loss"][steps - FINAL_WINDOWS : steps])
        result["final_loss_vs_float32_same_steps"] = result["final_loss"] / at_steps
        print(
            f"{name:26s} final loss {result['final_loss']:.4f} "
            f"(x{result['final_loss_vs_float32']:.3f} of float32, "
            f"x{result['final_loss_vs_float32_same_steps']:.3f} at as many steps), "
            f"{result['optimizer_steps']} steps, "
            f"{result['windows_skipped']} windows skipped, "
            f"{result['microbatches_dropped']} micro-batches dropped "
            f"({result['steps_with_dropped_microbatch']} steps altered), "
            f"{result['windows_with_scale_change']} windows with a scale change, "
            f"final scale 2**{result['final_log2_scale']:.0f} "
            f"({seconds[name]:.0f} s)"
        )
    setup = {
        "model": "-".join(map(str, SIZES)) + " tanh MLP, teacher labels",
        "activations": "float16 (master parameters float32)",
        "windows": WINDOWS,
        "num_microbatches": NUM_MICROBATCHES,
        "microbatch_size": MICROBATCH_SIZE,
        "loss_weight": LOSS_WEIGHT,
        "learning_rate": LEARNING_RATE,
        "initial_scale": INITIAL_SCALE,
        "period": PERIOD,
        "factor": FACTOR,
        "min_loss_scale": FLOOR,
        "final_windows": FINAL_WINDOWS,
        "seconds": seconds,
    }
    path = write_json("loss_scale", {"setup": setup, "results": results})
    plot(results, RESULTS / "loss_scale.png")
    print(f"Wrote {path} and {RESULTS / 'loss_scale.png'}")


if __name__ == "__main__":
    main()
