"""The ``jaxaccum`` command: ``demo``, ``bench`` and ``plan``.

* ``jaxaccum demo``: trains a small Flax MLP on synthetic data with an
  effective batch whose full-batch step does not fit a stated memory budget;
  picks N with :func:`jaxaccum.plan`, proves the first step equals the
  full-batch step, trains with a progress bar, prints the comparison table and
  writes a loss-curve PNG.
* ``jaxaccum bench``: the side-by-side benchmark of :mod:`jaxaccum.bench`
  (jaxaccum, full batch, optax.microbatching, an unrolled loop, optax.MultiSteps)
  with a markdown table, JSON and PNG plots.
* ``jaxaccum plan``: the memory planner on the demo model.
"""

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from jaxaccum import _models, bench, memory, testing
from jaxaccum.grad import value_and_grad

console = Console()

DEMO_RTOL, DEMO_ATOL = 1e-4, 1e-6


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _demo_task(args: argparse.Namespace) -> _models.Task:
    return _models.mlp_task(
        features=args.features, hidden=(args.width, args.width), seed=args.seed
    )


def _train_step(loss, num_microbatches, optimizer):
    """The jitted full-batch (``num_microbatches=None``) or accumulated step."""
    grad_fn = (
        jax.value_and_grad(loss)
        if num_microbatches is None
        else value_and_grad(loss, num_microbatches)
    )
    return jax.jit(bench.window_step(grad_fn, optimizer))


def _plan(task: _models.Task, args: argparse.Namespace) -> memory.MemoryPlan:
    batch = jax.eval_shape(lambda: task.make_batch(jax.random.key(0), args.batch_size))
    return memory.plan(
        task.loss,
        task.params,
        batch,
        memory_budget=args.memory_budget,
        optimizer=optax.adam(args.learning_rate),
    )


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the demo; returns its summary (also written as summary.json)."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = _demo_task(args)
    console.rule("[bold]jaxaccum demo")
    console.print(
        f"Model {task.name}, synthetic teacher-labelled data, effective batch "
        f"{args.batch_size}, Adam, memory budget {args.memory_budget}."
    )

    memory_plan = _plan(task, args)
    full_row = next((r for r in memory_plan.rows if r.num_microbatches == 1), None)
    num = args.num_microbatches or memory_plan.num_microbatches
    console.print(str(memory_plan))
    if full_row is not None and not full_row.fits:
        console.print(
            f"The full-batch step needs {_mib(full_row.total_bytes)}, over the "
            f"budget: accumulating over N={num} micro-batches of "
            f"{args.batch_size // num} instead."
        )
    console.print(
        f"Effective batch = {args.batch_size // num} x {num} = {args.batch_size}."
    )

    optimizer = optax.adam(args.learning_rate)
    first_batch = task.make_batch(jax.random.key(args.seed), args.batch_size)
    testing.assert_grads_match_full_batch(
        task.loss,
        task.params,
        first_batch,
        num_microbatches=num,
        rtol=DEMO_RTOL,
        atol=DEMO_ATOL,
    )
    console.print(
        f"[green]Equivalence proven:[/] the accumulated gradient of the first "
        f"batch equals the full-batch gradient (rtol={DEMO_RTOL}, atol={DEMO_ATOL})."
    )

    comparison = _compare(task, first_batch, num, optimizer, args.repeats)
    losses = _train(task, num, optimizer, args)
    table = Table(title="Full batch vs accumulated (one Adam step)")
    for column in ("", "full batch", f"jaxaccum N={num}"):
        table.add_column(column, justify="right")
    for label, key, fmt in (
        ("max |grad error| vs full batch", "max_grad_error", "{:.2e}"),
        ("compiled temp memory", "temp_bytes", None),
        ("compiled total memory", "total_bytes", None),
        ("time per step", "step_seconds", "{:.3f} s"),
    ):
        cells = [comparison[name][key] for name in ("full_batch", "jaxaccum")]
        table.add_row(label, *(fmt.format(c) if fmt else _mib(c) for c in cells))
    console.print(table)

    png = out / "loss.png"
    _plot_losses(
        losses,
        png,
        f"{task.name}, batch {args.batch_size} = {args.batch_size // num} x {num}",
    )
    summary = {
        "model": task.name,
        "batch_size": args.batch_size,
        "num_microbatches": num,
        "memory_budget_bytes": memory_plan.memory_budget,
        "losses": losses,
        "comparison": comparison,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(
        f"Loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps. "
        f"Wrote {png} and {out / 'summary.json'}."
    )
    return summary


def _compare(task, batch, num, optimizer, repeats) -> dict[str, dict[str, float]]:
    """Gradient error, compiled memory and step time: full batch vs jaxaccum."""
    opt_state = optimizer.init(task.params)
    full_grads = jax.jit(jax.grad(task.loss))(task.params, batch)
    accumulated = jax.jit(value_and_grad(task.loss, num))(task.params, batch)[1]
    results = {}
    for name, grads, n in (
        ("full_batch", full_grads, None),
        ("jaxaccum", accumulated, num),
    ):
        step = _train_step(task.loss, n, optimizer)
        compiled = step.lower(task.params, opt_state, batch).compile()
        temp, total = bench.footprint(compiled)
        seconds = bench.median_seconds(
            lambda compiled=compiled: compiled(task.params, opt_state, batch), repeats
        )
        errors = testing.leaf_errors(grads, full_grads)
        results[name] = {
            "max_grad_error": max(error[1] for error in errors),
            "temp_bytes": temp,
            "total_bytes": total,
            "step_seconds": seconds,
        }
    return results


def _train(task, num, optimizer, args) -> list[float]:
    step = _train_step(task.loss, num, optimizer)
    params, opt_state = task.params, optimizer.init(task.params)
    losses = []
    data_key = jax.random.key(args.seed + 1)
    with Progress(
        TextColumn("training"),
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
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            speed = (index + 1) * args.batch_size / (time.perf_counter() - start)
            progress.update(
                bar,
                advance=1,
                loss=f"{losses[-1]:.4f}",
                speed=f"{speed:,.0f} examples/s",
            )
    return losses


def _plot_losses(losses: Sequence[float], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(np.arange(1, len(losses) + 1), losses)
    axis.set(xlabel="optimizer step (one window)", ylabel="training loss", title=title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plan_command(args: argparse.Namespace) -> memory.MemoryPlan:
    task = _demo_task(args)
    result = _plan(task, args)
    console.print(f"Model {task.name}, Adam; parameters and optimizer state count.")
    console.print(str(result))
    console.print(
        "Use jaxaccum.value_and_grad(loss, "
        f"num_microbatches={result.num_microbatches})."
    )
    return result


def bench_command(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark suite; returns what it writes to results.json."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {
        "mlp": (_models.mlp_task(), args.batch_size),
        "transformer": (_models.transformer_task(), args.sequence_batch_size),
        "cnn": (_models.cnn_task(), args.image_batch_size),
    }
    selected = ["mlp"] if args.quick else args.models
    results: dict[str, Any] = {"machine": bench.machine(), "models": {}}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        disable=args.quiet,
    ) as progress:
        runs = len(selected) * (
            1 + (len(bench.CONTENDERS) - 1) * len(args.num_microbatches)
        )
        bar = progress.add_task("bench", total=runs)

        def advance(description: str) -> None:
            progress.update(bar, advance=1, description=description)

        for name in selected:
            task, batch_size = tasks[name]
            measurements = bench.run_suite(
                task,
                batch_size,
                args.num_microbatches,
                repeats=args.repeats,
                progress=advance,
            )
            results["models"][name] = {
                "task": task.name,
                "batch_size": batch_size,
                "measurements": [m.__dict__ for m in measurements],
            }
        compile_task = tasks["mlp"]
        progress.update(bar, description="compile time vs N")
        results["compile_seconds"] = {
            "task": compile_task[0].name,
            "batch_size": compile_task[1],
            "seconds": bench.compile_seconds_vs_n(
                compile_task[0],
                compile_task[1],
                args.compile_num_microbatches,
                contenders=("jaxaccum",) if args.quick else ("jaxaccum", "unrolled"),
            ),
        }
    results["ratios"] = _ratios(results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = _markdown(results)
    (out / "results.md").write_text(markdown)
    _plot_bench(results, out)
    console.print(markdown)
    console.print(f"Wrote {out / 'results.json'}, {out / 'results.md'} and plots.")
    return results


def _step_seconds(measurements: list[dict], contender: str, num: int) -> float | None:
    for m in measurements:
        if m["contender"] == contender and m["num_microbatches"] == num:
            return m["step_seconds"]
    return None


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """The headline ratios (MLP; compile time N=max vs N=min), where measured."""
    ratios = {}
    if "mlp" in results["models"]:
        measurements = results["models"]["mlp"]["measurements"]
        full = _step_seconds(measurements, "full_batch", 1)
        for m in measurements:
            if m["contender"] != "jaxaccum":
                continue
            num = m["num_microbatches"]
            ratios[f"mlp N={num}: jaxaccum / full_batch"] = m["step_seconds"] / full
            multisteps = _step_seconds(measurements, "optax_multisteps", num)
            if multisteps:
                ratios[f"mlp N={num}: jaxaccum / optax_multisteps"] = (
                    m["step_seconds"] / multisteps
                )
    seconds = results["compile_seconds"]["seconds"]["jaxaccum"]
    low, high = min(seconds, key=int), max(seconds, key=int)
    ratios[f"compile jaxaccum N={high} / N={low}"] = seconds[high] / seconds[low]
    return ratios


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']}", ""]
    lines += [
        "| model | batch | method | N | time / window | vs full batch "
        "| temp memory | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in results["models"].values():
        measurements = model["measurements"]
        full = _step_seconds(measurements, "full_batch", 1)
        for m in measurements:
            lines.append(
                f"| {model['task']} | {model['batch_size']} | {m['contender']} | "
                f"{m['num_microbatches']} | {m['step_seconds'] * 1e3:.1f} ms | "
                f"{m['step_seconds'] / full:.2f}x | {_mib(m['temp_bytes'])} | "
                f"{m['compile_seconds']:.2f} s |"
            )
    compile_seconds = results["compile_seconds"]
    lines += [
        "",
        f"Compile seconds vs N ({compile_seconds['task']}, batch "
        f"{compile_seconds['batch_size']}):",
        "",
        "| method | "
        + " | ".join(f"N={n}" for n in next(iter(compile_seconds["seconds"].values())))
        + " |",
        "|---|" + "---|" * len(next(iter(compile_seconds["seconds"].values()))),
    ]
    for contender, by_n in compile_seconds["seconds"].items():
        lines.append(
            f"| {contender} | " + " | ".join(f"{s:.2f} s" for s in by_n.values()) + " |"
        )
    lines += ["", "Ratios:", ""]
    lines += [f"- {name}: {ratio:.2f}x" for name, ratio in results["ratios"].items()]
    return "\n".join(lines) + "\n"


def _plot_bench(results: dict[str, Any], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    figure, axes = plt.subplots(
        2, len(models), figsize=(5 * len(models), 7), squeeze=False
    )
    for column, model in enumerate(models.values()):
        by_contender: dict[str, list[dict]] = {}
        for m in model["measurements"]:
            by_contender.setdefault(m["contender"], []).append(m)
        for contender, ms in by_contender.items():
            if contender == "full_batch":
                axes[0, column].axhline(
                    ms[0]["step_seconds"] * 1e3, color="k", ls="--", label=contender
                )
                axes[1, column].axhline(
                    ms[0]["temp_bytes"] / 2**20, color="k", ls="--", label=contender
                )
                continue
            ns = [m["num_microbatches"] for m in ms]
            axes[0, column].plot(
                ns, [m["step_seconds"] * 1e3 for m in ms], "-o", label=contender
            )
            axes[1, column].plot(
                ns, [m["temp_bytes"] / 2**20 for m in ms], "-o", label=contender
            )
        axes[0, column].set(
            title=f"{model['task']}, batch {model['batch_size']}",
            ylabel="ms per window",
            xscale="log",
            xlabel="N",
        )
        axes[1, column].set(
            ylabel="compiled temp MiB", xscale="log", xlabel="N", yscale="log"
        )
        axes[0, column].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "time_memory_vs_n.png", dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for contender, by_n in results["compile_seconds"]["seconds"].items():
        axis.plot([int(n) for n in by_n], list(by_n.values()), "-o", label=contender)
    axis.set(
        xlabel="N", ylabel="compile seconds", xscale="log", title="Compile time vs N"
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "compile_vs_n.png", dpi=110)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxaccum", description="Exact, compiled gradient accumulation for JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def model_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--batch-size",
            type=int,
            default=8192,
            help="effective batch size (default 8192)",
        )
        sub.add_argument("--features", type=int, default=784)
        sub.add_argument("--width", type=int, default=512, help="hidden width")
        sub.add_argument(
            "--memory-budget",
            default="48MiB",
            help="bytes or e.g. 48MiB, 1GB, 'device' (default 48MiB)",
        )
        sub.add_argument("--learning-rate", type=float, default=1e-3)
        sub.add_argument("--seed", type=int, default=0)

    demo_parser = commands.add_parser("demo", help="train with accumulation")
    model_options(demo_parser)
    demo_parser.add_argument("--steps", type=int, default=100)
    demo_parser.add_argument(
        "--num-microbatches",
        type=int,
        default=None,
        help="override the planner's choice",
    )
    demo_parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats for the comparison table"
    )
    demo_parser.add_argument("--out", default="jaxaccum-demo")
    demo_parser.add_argument("--quiet", action="store_true", help="no progress bar")

    plan_parser = commands.add_parser("plan", help="choose N for a memory budget")
    model_options(plan_parser)

    bench_parser = commands.add_parser("bench", help="compare with optax and JAX")
    bench_parser.add_argument(
        "--quick", action="store_true", help="MLP only, fewer N (a few minutes)"
    )
    bench_parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "transformer", "cnn"],
        choices=["mlp", "transformer", "cnn"],
    )
    bench_parser.add_argument(
        "--batch-size", type=int, default=8192, help="MLP batch size"
    )
    bench_parser.add_argument("--sequence-batch-size", type=int, default=512)
    bench_parser.add_argument("--image-batch-size", type=int, default=1024)
    bench_parser.add_argument("--num-microbatches", type=int, nargs="+", default=None)
    bench_parser.add_argument(
        "--compile-num-microbatches", type=int, nargs="+", default=None
    )
    bench_parser.add_argument("--repeats", type=int, default=None)
    bench_parser.add_argument("--out", default="jaxaccum-bench")
    bench_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxaccum`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        demo(args)
    elif args.command == "plan":
        plan_command(args)
    else:
        args.num_microbatches = args.num_microbatches or (
            [8, 16] if args.quick else [1, 2, 4, 8, 16, 32]
        )
        args.compile_num_microbatches = args.compile_num_microbatches or (
            [2, 64] if args.quick else [2, 8, 32, 64]
        )
        args.repeats = args.repeats or (3 if args.quick else 5)
        bench_command(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
