"""``jaxaccum demo``: plan N for a budget, prove equivalence, train, compare.

Trains a small Flax MLP on synthetic data with an effective batch whose
full-batch step does not fit a stated memory budget: picks N with
:func:`jaxaccum.plan`, proves the first step equals the full-batch step,
trains the full-batch and the accumulated step on the same batches, prints the
comparison table, writes the two loss curves, overlaid, to a PNG, and ends on
what the trained model's gradient noise scale says of the batch.

Every memory figure it prints is the planner's: the same compiled train step
(gradients, Adam update, parameters and optimizer state donated), so the plan
and the comparison table cannot disagree.
"""

import argparse
import json
import math
import pathlib
import time
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

import jaxaccum
import jaxaccum.growth
from jaxaccum._checks import check_scalar
from jaxaccum._plan._plan import format_bytes, measure, train_step
from jaxaccum._types import Batch, PyTree
from jaxaccum._window._spec import WindowSpec
from jaxaccum.cli import models
from jaxaccum.cli._console import console
from jaxaccum.cli._flags import check_divides


def check_flags(args: argparse.Namespace) -> None:
    """Checks the flags together, before any work: ``--num-microbatches``
    divides ``--batch-size``, and the batch has the 2 examples or more that
    the noise scale's estimate needs (2 micro-batches, see
    :func:`_noise_scale_microbatches`).

    Raises:
      ValueError: naming the flags and the values.
    """
    try:
        check_scalar(
            "the batch size",
            args.batch_size,
            integer=True,
            low=2,
            hint="The demo estimates the gradient noise scale from 2 or more "
            "micro-batches of the batch.",
        )
    except ValueError as error:
        raise ValueError(f"argument --batch-size: {error}") from error
    if args.num_microbatches is not None:
        check_divides(
            "--num-microbatches",
            [args.num_microbatches],
            "--batch-size",
            args.batch_size,
        )


def demo_task(args: argparse.Namespace) -> models.Task:
    return models.mlp_task(
        features=args.features, hidden=(args.width, args.width), seed=args.seed
    )


def batch_shapes(task: models.Task, batch_size: int) -> PyTree:
    return jax.eval_shape(lambda: task.make_batch(jax.random.key(0), batch_size))


def _jitted_train_step(task: models.Task, num: int, optimizer) -> Callable:
    """The planner's train step for ``N = num``: ``step(opt_state, params,
    batch) -> (loss, params, opt_state)``, jitted with the optimizer state and
    the parameters donated."""
    grads = jaxaccum.value_and_grad(task.loss, num)
    step, _, donate = train_step(grads, (task.params, None), optimizer, 0)
    return jax.jit(step, donate_argnums=donate)


def _memory(task: models.Task, args: argparse.Namespace, num: int):
    """The planner's row for ``N = num``: the same measurement, the same step."""
    return measure(
        task.loss,
        (task.params, batch_shapes(task, args.batch_size)),
        num,
        args.batch_size,
        jaxaccum.parse_memory_budget(args.memory_budget),
        optax.adam(args.learning_rate),
        WindowSpec(num),
    )


def _copy(tree: PyTree) -> PyTree:
    """A copy to donate, so that the task's own arrays stay valid."""
    return jax.tree.map(jnp.copy, tree)


def _plan(task: models.Task, args: argparse.Namespace) -> jaxaccum.MemoryPlan:
    return jaxaccum.plan(
        task.loss,
        task.params,
        batch_shapes(task, args.batch_size),
        memory_budget=args.memory_budget,
        optimizer=optax.adam(args.learning_rate),
    )


def _rows_for(task, args, memory_plan, numbers: Sequence[int]) -> dict:
    """The plan's rows for ``numbers``, measuring those it did not compile."""
    rows = {row.num_microbatches: row for row in memory_plan.rows}
    return {num: rows.get(num) or _memory(task, args, num) for num in numbers}


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the demo; returns its summary (also written as summary.json)."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = demo_task(args)
    console.rule("[bold]jaxaccum demo")
    console.print(
        f"Model {task.name}, synthetic teacher-labelled data, effective batch "
        f"{args.batch_size}, Adam, memory budget {args.memory_budget}."
    )
    memory_plan = _plan(task, args)
    num = (
        memory_plan.num_microbatches
        if args.num_microbatches is None
        else args.num_microbatches
    )
    rows = _rows_for(task, args, memory_plan, (1, num))
    _print_plan(memory_plan, rows[1], num, args.batch_size)
    first_batch = task.make_batch(jax.random.key(args.seed), args.batch_size)
    _prove(task, first_batch, num)
    comparison = _compare(task, first_batch, num, args, rows)
    runs = {name: _train(task, n, args) for name, n in _contenders(num).items()}
    losses = {name: run[0] for name, run in runs.items()}
    noise_scale = _noise_scale(task, runs["jaxaccum"][1], num, args)
    png = out / "loss.png"
    _plot_losses(
        losses,
        png,
        f"{task.name}, batch {args.batch_size} = {args.batch_size // num} x {num}",
        num,
    )
    summary = {
        "model": task.name,
        "batch_size": args.batch_size,
        "num_microbatches": num,
        "memory_budget_bytes": memory_plan.memory_budget,
        "plan": [row.__dict__ for row in memory_plan.rows],
        "losses": losses["jaxaccum"],
        "full_batch_losses": losses["full_batch"],
        "comparison": comparison,
        "noise_scale": noise_scale,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    gap = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    console.print(
        f"Loss {losses['jaxaccum'][0]:.3f} -> {losses['jaxaccum'][-1]:.3f} over "
        f"{len(losses['jaxaccum'])} steps; largest gap to the full-batch curve "
        f"{gap:.2e}. Wrote {png} and {out / 'summary.json'}."
    )
    _print_batch_advice(noise_scale, task, num, args)
    return summary


def _contenders(num: int) -> dict[str, int]:
    """The demo's two steps by name, and their number of micro-batches."""
    return {"full_batch": 1, "jaxaccum": num}


def _print_plan(memory_plan, full_row, num: int, batch_size: int) -> None:
    console.print(str(memory_plan))
    if not full_row.fits:
        console.print(
            f"The full-batch step needs {format_bytes(full_row.total_bytes)}, over "
            f"the budget: accumulating over N={num} micro-batches of "
            f"{batch_size // num} instead."
        )
    console.print(f"Effective batch = {batch_size // num} x {num} = {batch_size}.")


def _prove(task: models.Task, batch: Batch, num: int) -> None:
    # The same float32 sums over the batch in two orders: each errs by at most
    # (B - 1) u sum|t| (u = 2**-24; Higham, 4.2), so they differ by at most
    # 2 B u relative where terms do not cancel, and that times the mean
    # per-example gradient (< 1 on the demo's unit-scale data) where they do.
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    tolerance = 2 * batch_size * 2.0**-24
    jaxaccum.testing.assert_grads_match_full_batch(
        task.loss,
        task.params,
        batch,
        num_microbatches=num,
        rtol=tolerance,
        atol=tolerance,
    )
    console.print(
        f"[green]Equivalence proven:[/] the accumulated gradient of the first "
        f"batch equals the full-batch gradient (rtol = atol = {tolerance:.1e}: "
        "float32 rounding of the batch's sums in two orders)."
    )


def _compare(task, batch, num, args, rows) -> dict[str, dict[str, float]]:
    """Gradient error, compiled memory and step time: full batch vs jaxaccum."""
    full_grads = jax.jit(jax.grad(task.loss))(task.params, batch)
    results = {}
    for name, n in _contenders(num).items():
        grads = jax.jit(jaxaccum.grad(task.loss, n))(task.params, batch)
        errors = jaxaccum.testing.leaf_errors(grads, full_grads)
        results[name] = {
            "max_grad_error": max(error[1] for error in errors),
            "temp_bytes": rows[n].temp_bytes,
            "total_bytes": rows[n].total_bytes,
            "step_seconds": _step_seconds(task, batch, n, args),
        }
    table = Table(title="Full batch vs accumulated (one Adam step)")
    for column in ("", "full batch", f"jaxaccum N={num}"):
        table.add_column(column, justify="right")
    for label, key, fmt in (
        ("max |grad error| vs full batch", "max_grad_error", "{:.2e}"),
        ("compiled temp memory (as planned)", "temp_bytes", None),
        ("compiled total memory (as planned)", "total_bytes", None),
        ("time per train step (median)", "step_seconds", "{:.3f} s"),
    ):
        cells = [results[name][key] for name in ("full_batch", "jaxaccum")]
        table.add_row(
            label, *(fmt.format(c) if fmt else format_bytes(c) for c in cells)
        )
    console.print(table)
    console.print(
        "Memory: XLA's compiled account of the train step (gradients + Adam "
        "update, parameters and optimizer state donated): temporaries, and "
        "arguments + outputs + temporaries - donated. Time: the same step, "
        "median of the repeats after a warm-up."
    )
    return results


def _step_seconds(task, batch, num: int, args: argparse.Namespace) -> float:
    """Median seconds of the donated train step, fed its own outputs."""
    optimizer = optax.adam(args.learning_rate)
    step = _jitted_train_step(task, num, optimizer)
    opt_state, params = optimizer.init(task.params), _copy(task.params)

    def run() -> None:
        nonlocal opt_state, params
        _, params, opt_state = step(opt_state, params, batch)
        jax.block_until_ready(params)

    run()  # compile and warm up
    return float(np.median(timeit.repeat(run, number=1, repeat=args.repeats)))


def _noise_scale(task, params, num: int, args: argparse.Namespace) -> float:
    """B_simple of the trained model: the estimates of 16 windows averaged
    per example, with a half-life of 8 windows."""
    measured_num = _noise_scale_microbatches(num, args.batch_size)
    step = jax.jit(jaxaccum.value_and_grad(task.loss, measured_num, report_stats=True))
    ema = jaxaccum.growth.NoiseScaleEMA(half_life=8 * args.batch_size)
    state = ema.init()
    data_key = jax.random.key(args.seed + 2)
    for index in range(16):
        batch = task.make_batch(jax.random.fold_in(data_key, index), args.batch_size)
        state = ema.update(state, step(params, batch)[1])
    return float(ema.noise_scale(state))


def _print_batch_advice(noise_scale: float, task, num: int, args) -> None:
    """Prints what the noise scale says of the effective batch, with the
    step's measured cost (the time-optimal batch, McCandlish et al. 2018);
    one line where that cost is not resolved (timing noise: a busy machine,
    a small model), which leaves nothing to advise."""
    try:
        cost = _step_cost(task, num, args)
    except ValueError:
        console.print(
            f"Gradient noise scale B_simple {noise_scale:,.0f} examples; step "
            "cost lost in timing noise.",
            soft_wrap=True,
        )
        return
    best = math.sqrt(cost.step_cost * max(noise_scale, 0.0))
    if best > 1.25 * args.batch_size:
        verdict = "a bigger batch would reach this loss sooner"
    elif best < 0.8 * args.batch_size:
        verdict = "a smaller batch would reach this loss sooner"
    else:
        verdict = "the effective batch is about right"
    console.print(
        f"Gradient noise scale B_simple of the trained model {noise_scale:,.0f} "
        f"examples; a step here costs as much as {cost.step_cost:,.0f} "
        f"(+- {cost.step_cost_error:,.0f}) examples (measured). The time-optimal "
        "batch, sqrt(step cost x B_simple), is "
        f"about {best:,.0f} examples against the effective {args.batch_size}: "
        f"{verdict} (McCandlish et al. 2018; docs/guides/growing-the-batch.md: "
        f"jaxaccum.growth.NoiseScaleBatch(..., step_cost={cost.step_cost:.0f}) "
        "follows it while training)."
    )


def _noise_scale_microbatches(num: int, batch_size: int) -> int:
    """The micro-batches the noise scale is estimated over: ``num``, or with
    one (whose one batch size gives no estimate) the fewest above 1 that
    divide ``batch_size``, which must be at least 2.

    Examples:
      >>> [_noise_scale_microbatches(1, size) for size in (256, 255, 7)]
      [2, 3, 7]
      >>> _noise_scale_microbatches(4, 256)
      4
    """
    if num > 1:
        return num
    return next(n for n in range(2, batch_size + 1) if batch_size % n == 0)


def _step_cost(task, num: int, args: argparse.Namespace) -> jaxaccum.growth.StepCost:
    """The demo step's cost in examples: windows of 1 and ``max(num, 8)``
    micro-batches of the demo's size, timed (one program each; the small
    window small, so that the line through them is short of no examples)."""
    microbatch_size = args.batch_size // num
    sizes = (1, max(num, 8))
    optimizer = optax.adam(args.learning_rate)
    steps = {size: _jitted_train_step(task, size, optimizer) for size in sizes}
    batches = {
        size: task.make_batch(jax.random.key(args.seed + 3), size * microbatch_size)
        for size in steps
    }
    state = {"opt_state": optimizer.init(task.params), "params": _copy(task.params)}

    def window_step(size: int) -> PyTree:
        _, state["params"], state["opt_state"] = steps[size](
            state["opt_state"], state["params"], batches[size]
        )
        return state["params"]

    # Its scatter needs 3 timings or more, whatever --repeats the table uses.
    return jaxaccum.growth.measure_step_cost(
        window_step, microbatch_size, sizes, repeats=max(args.repeats, 3)
    )


def _train(
    task: models.Task, num: int, args: argparse.Namespace
) -> tuple[list[float], Any]:
    """Trains ``args.steps`` steps; returns the losses and the parameters."""
    optimizer = optax.adam(args.learning_rate)
    step = _jitted_train_step(task, num, optimizer)
    opt_state, params = optimizer.init(task.params), _copy(task.params)
    losses: list[float] = []
    data_key = jax.random.key(args.seed + 1)
    label = "full batch" if num == 1 else f"N={num}"
    with Progress(
        TextColumn(f"training ({label})"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[speed]}"),
        console=console,
        disable=args.quiet,
    ) as progress:
        bar = progress.add_task("train", total=args.steps, loss="-", speed="")
        start = time.perf_counter()
        for index in range(args.steps):
            batch = task.make_batch(
                jax.random.fold_in(data_key, index), args.batch_size
            )
            loss, params, opt_state = step(opt_state, params, batch)
            losses.append(float(loss))
            speed = (index + 1) * args.batch_size / (time.perf_counter() - start)
            progress.update(
                bar,
                advance=1,
                loss=f"{losses[-1]:.4f}",
                speed=f"{speed:,.0f} examples/s",
            )
    return losses, params


def _plot_losses(
    losses: dict[str, list[float]], path: pathlib.Path, title: str, num: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    steps = np.arange(1, len(losses["full_batch"]) + 1)
    axis.plot(steps, losses["full_batch"], color="k", lw=3, alpha=0.35)
    axis.plot(steps, losses["jaxaccum"], color="C1", lw=1.2, ls="--")
    axis.legend(["full batch, one step", f"jaxaccum, N={num} micro-batches"])
    axis.set(xlabel="optimizer step (one window)", ylabel="training loss", title=title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
