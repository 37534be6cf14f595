"""The side-by-side benchmark behind ``jaxaccum bench``: results, tables, plots."""

import argparse
import copy
import json
import pathlib
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from jaxaccum._plan._plan import format_bytes
from jaxaccum.cli import harness, models
from jaxaccum.cli._console import console
from jaxaccum.cli._flags import check_divides

# The defaults that depend on --quick: (without it, with it).
QUICK_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "num_microbatches": ([1, 2, 4, 8, 16, 32], [8, 16]),
    "compile_num_microbatches": ([2, 8, 32, 64], [2, 64]),
    "repeats": (5, 3),
}
# Each model's batch size flag, and the argument it sets.
_BATCH_SIZE_FLAGS = {
    "mlp": ("--batch-size", "batch_size"),
    "transformer": ("--sequence-batch-size", "sequence_batch_size"),
    "cnn": ("--image-batch-size", "image_batch_size"),
}


def fill_defaults(args: argparse.Namespace) -> None:
    """Sets the flags left out (None) whose defaults depend on ``--quick``; a
    value given, 0 included, is kept (and checked), never replaced."""
    for name, (full, quick) in QUICK_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, copy.copy(quick if args.quick else full))


def _selected(args: argparse.Namespace) -> list[str]:
    """The models measured: the MLP alone with ``--quick``."""
    return ["mlp"] if args.quick else args.models


def check_flags(args: argparse.Namespace) -> None:
    """Checks the flags together, before any work: each number of
    micro-batches divides the batch of every model it splits (the compile-time
    sweep splits the MLP's).

    Raises:
      ValueError: naming the flags and the values that do not divide.
    """
    for model in _selected(args):
        flag, name = _BATCH_SIZE_FLAGS[model]
        check_divides(
            "--num-microbatches", args.num_microbatches, flag, getattr(args, name)
        )
    check_divides(
        "--compile-num-microbatches",
        args.compile_num_microbatches,
        "--batch-size",
        args.batch_size,
    )


def bench_command(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark suite; returns what it writes to results.json."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {
        "mlp": (models.mlp_task(), args.batch_size),
        "transformer": (models.transformer_task(), args.sequence_batch_size),
        "cnn": (models.cnn_task(), args.image_batch_size),
    }
    selected = _selected(args)
    results: dict[str, Any] = {"machine": harness.machine(), "models": {}}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        disable=args.quiet,
    ) as progress:
        runs = len(selected) * (
            1 + (len(harness.CONTENDERS) - 1) * len(args.num_microbatches)
        )
        bar = progress.add_task("bench", total=runs)

        def advance(description: str) -> None:
            progress.update(bar, advance=1, description=description)

        for name in selected:
            task, batch_size = tasks[name]
            measurements = harness.run_suite(
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
            "seconds": harness.compile_seconds_vs_n(
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
                f"{m['step_seconds'] / full:.2f}x | {format_bytes(m['temp_bytes'])} | "
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
        )
        axes[1, column].set(ylabel="compiled temp MiB", yscale="log")
        measured = sorted({m["num_microbatches"] for m in model["measurements"]})
        for row in (0, 1):
            _label_measured_n(axes[row, column], measured)
        axes[0, column].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "time_memory_vs_n.png", dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(5, 3.5))
    compiled_n: set[int] = set()
    for contender, by_n in results["compile_seconds"]["seconds"].items():
        compiled_n.update(int(n) for n in by_n)
        axis.plot([int(n) for n in by_n], list(by_n.values()), "-o", label=contender)
    axis.set(ylabel="compile seconds", title="Compile time vs N")
    _label_measured_n(axis, sorted(compiled_n))
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "compile_vs_n.png", dpi=110)
    plt.close(figure)


def _label_measured_n(axis: Any, measured: list[int]) -> None:
    """A log-2 N axis labelled at the measured N only (matplotlib's log axis
    also labels minor ticks, 2x10^0, 3x10^0, ..., which overlap)."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(measured, [str(n) for n in measured])
    axis.minorticks_off()
    axis.set_xlabel("N")
