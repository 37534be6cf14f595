"""The step users write with MultiSteps: `jaxaccum.MultiSteps` vs `optax.MultiSteps`.

One train step: gradients in, ``optimizer.update(grads, state, params)``,
``optax.apply_updates``, jitted; window of k=8 calls. Each library runs in two
configurations: the parameters and the optimizer state donated, and nothing
donated. Every figure compares against **optax's fastest configuration** (the
faster of its two, call by call type), the ratio per round.

A round runs each (library, configuration) for 32 chained calls (4 windows),
interleaved, and keeps the median of its 28 mid-window calls and of its 4
emitting calls. Rounds repeat within a process, and the whole run repeats in
fresh processes (a process's first allocations can differ from its later ones,
and from another process's): min / median / max over every round of every
process. Also recorded: compiled temp memory and the ``copy`` ops of the
optimised HLO.

Run: python benchmarks/multisteps.py   (writes benchmarks/results/multisteps.json)
     python benchmarks/multisteps.py --quick   (12M Adam only, writes nothing)
     python benchmarks/multisteps.py --bare    (update alone: multisteps_bare.json)
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
from common import spread, write_json

import jaxaccum

EVERY_K = 8
CALLS = 4 * EVERY_K
SIZES = {"1M": 1, "12M": 12, "50M": 50}  # that many 1000 x 1000 float32 matrices
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw+clip": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4)
    ),
    "adafactor": lambda: optax.adafactor(1e-3),
}
LIBRARIES = {"jaxaccum": jaxaccum.MultiSteps, "optax": optax.MultiSteps}
CONFIGS = {"donated": (0, 1), "not_donated": ()}
# With ``--bare``, ``update(grads, state, params)`` is jitted alone and
# "donated" donates the gradients and the state (JAX pairs donated inputs with
# outputs in order, and ``updates`` comes first).


def count_copies(hlo_text: str) -> int:
    """``copy`` ops of non-scalar arrays in an optimised HLO module."""
    shapes = re.findall(r"= (\S+) copy(?:-start)?\(", hlo_text)
    return sum("[]" not in shape for shape in shapes)


def build(library: str, optimizer_name: str, size: str, config: str, kind="train_step"):
    """The compiled step, its first arguments, and its HLO figures.

    ``kind="train_step"`` runs ``(params, state, grads) -> (params, state)``;
    ``"update"`` the bare ``(grads, state, params) -> (updates, state)``, whose
    zero updates are fed back as the next call's gradients (no cost changes).
    """
    optimizer = LIBRARIES[library](OPTIMIZERS[optimizer_name](), EVERY_K)
    keys = jax.random.split(jax.random.key(0), SIZES[size])
    params = [jax.random.normal(key, (1000, 1000)) * 0.01 for key in keys]
    grads = [jnp.full((1000, 1000), 1e-3) for _ in keys]

    def train_step(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fun, first = (
        (train_step, params)
        if kind == "train_step"
        else (
            optimizer.update,
            grads,
        )
    )
    step = jax.jit(fun, donate_argnums=CONFIGS[config])
    state = optimizer.init(params)
    other = grads if kind == "train_step" else params
    compiled = step.lower(first, state, other).compile()
    figures = {
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "hlo_array_copies": count_copies(compiled.as_text()),
    }
    return compiled, [first, state, other], figures


def run_round(compiled, args: list) -> dict[str, float]:
    """CALLS chained calls; median seconds of mid-window and emitting calls."""
    mid, emit = [], []
    for call in range(CALLS):
        start = time.perf_counter()
        args[0], args[1] = compiled(*args)
        jax.block_until_ready(args[:2])
        (emit if (call + 1) % EVERY_K == 0 else mid).append(time.perf_counter() - start)
    return {"mid": statistics.median(mid), "emit": statistics.median(emit)}


def one_process(optimizer_name: str, size: str, rounds: int, kind: str) -> dict:
    """Every (library, config) of one case, ``rounds`` interleaved rounds."""
    built = {
        (library, config): build(library, optimizer_name, size, config, kind)
        for library in LIBRARIES
        for config in CONFIGS
    }
    seconds: dict = {name: [] for name in built}
    for _ in range(rounds):
        for name, (compiled, args, _) in built.items():
            seconds[name].append(run_round(compiled, args))
    return {
        f"{library}/{config}": {"rounds": seconds[(library, config)], **figures}
        for (library, config), (_, _, figures) in built.items()
    }


def summarize(processes: list[dict]) -> dict:
    """Ratios per round against optax's fastest configuration of that round."""
    summary = {}
    for name in processes[0]:
        summary[name] = {
            key: processes[0][name][key] for key in ("temp_bytes", "hlo_array_copies")
        }
        for call in ("mid", "emit"):
            ratios, milliseconds = [], []
            for process in processes:
                for index, measured in enumerate(process[name]["rounds"]):
                    best_optax = min(
                        process[f"optax/{config}"]["rounds"][index][call]
                        for config in CONFIGS
                    )
                    ratios.append(measured[call] / best_optax)
                    milliseconds.append(measured[call] * 1e3)
            summary[name][f"{call}_ms"] = spread(milliseconds)
            summary[name][f"{call}_vs_optax_fastest"] = spread(ratios)
    return summary


def run_in_processes(
    optimizer_name: str, size: str, processes: int, rounds: int, kind: str
):
    results = []
    for _ in range(processes):
        output = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                optimizer_name,
                size,
                str(rounds),
                kind,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(output.splitlines()[-1]))
    return summarize(results)


def print_case(case: str, summary: dict) -> None:
    print(f"\n{case}: ratio to optax's fastest configuration (min / median / max)")
    for name, row in summary.items():
        mid, emit = row["mid_vs_optax_fastest"], row["emit_vs_optax_fastest"]
        print(
            f"  {name:<21} mid {row['mid_ms']['median']:7.2f} ms "
            f"x{mid['min']:.2f}/{mid['median']:.2f}/{mid['max']:.2f}   emit "
            f"{row['emit_ms']['median']:7.2f} ms "
            f"x{emit['min']:.2f}/{emit['median']:.2f}/{emit['max']:.2f}   "
            f"copies {row['hlo_array_copies']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12M Adam only")
    parser.add_argument(
        "--bare", action="store_true", help="the bare update, 12M Adam only"
    )
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        optimizer_name, size, rounds, kind = args.one
        print(json.dumps(one_process(optimizer_name, size, int(rounds), kind)))
        return
    kind = "update" if args.bare else "train_step"
    cases = (
        [("adam", "12M")]
        if args.quick or args.bare
        else [(optimizer_name, size) for size in SIZES for optimizer_name in OPTIMIZERS]
    )
    results = {}
    for optimizer_name, size in cases:
        case = f"{size} {optimizer_name}" + (", bare update" if args.bare else "")
        results[case] = run_in_processes(
            optimizer_name, size, args.processes, args.rounds, kind
        )
        print_case(case, results[case])
    if not args.quick:
        path = write_json(
            "multisteps_bare" if args.bare else "multisteps",
            {
                "every_k": EVERY_K,
                "calls_per_round": CALLS,
                "processes": args.processes,
                "rounds_per_process": args.rounds,
                "cases": results,
            },
        )
        print(f"Wrote {path}")


if __name__ == "__main__":
    main()
