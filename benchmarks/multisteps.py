"""Cost of one non-emitting mini-step: `jaxaccum.MultiSteps` vs `optax.MultiSteps`.

Both wrap ``optax.adam`` over a pytree of about 11.5M float32 parameters.
``update(grads, state, params)`` is jitted three ways: with the gradients and
the state donated (the headline figure), with only the state donated (JAX then
pairs the first donated state buffers with the ``updates`` output, so XLA must
copy), and without donation; a fourth config jits a training step that applies
the updates, with the params and the state donated. For each we record the
median time of a mini-step that does not emit, the compiled temp memory, and
the ``copy(`` ops in the optimized HLO. Both libraries are timed in the same
run, alternately, and the ratio is the median of the per-round ratios, so
machine noise hits both alike.

Run: ``python benchmarks/multisteps.py``; writes
``benchmarks/results/multisteps.json`` and prints a table.
"""

import json
import platform
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import jaxaccum

# Large enough that no timed call completes a window.
CALLS_PER_WINDOW = 1_000_000
# Config name -> (jitted function, donate_argnums), see `step_fns`.
DONATION = {
    "donated": ("update", (0, 1)),
    "state_donated": ("update", (1,)),
    "not_donated": ("update", ()),
    "train_step": ("train_step", (0, 1)),
}
ROUNDS = 15
CALLS_PER_ROUND = 5
RESULTS_PATH = Path(__file__).parent / "results" / "multisteps.json"


def make_params() -> dict:
    """A small transformer-like pytree: an embedding and three MLP blocks."""
    width, hidden = 512, 2048
    layers = [
        {
            "w_in": jnp.zeros((width, hidden)),
            "b_in": jnp.zeros((hidden,)),
            "w_out": jnp.zeros((hidden, width)),
            "w_gate": jnp.zeros((width, hidden)),
        }
        for _ in range(3)
    ]
    return {"embed": jnp.zeros((4096, width)), "layers": layers}


def count_copies(hlo_text: str) -> tuple[int, int]:
    """Returns the number of ``copy(`` ops and how many copy a non-scalar."""
    copies = re.findall(r"= (\S+) copy\(", hlo_text)
    return len(copies), sum("[]" not in shape for shape in copies)


def step_fns(wrapper) -> dict:
    """Functions ``(carried, state, other) -> (carried, state)`` to time.

    ``update`` is the bare ``update(grads, state, params)``; ``train_step``
    applies the updates to the params, as a training step jitted with the
    params and the optimizer state donated does.
    """

    def train_step(params, state, grads):
        updates, state = wrapper.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return {"update": wrapper.update, "train_step": train_step}


def build(wrapper, params, config: str):
    """Returns the compiled step, its arguments and its HLO figures."""
    fn_name, donate_argnums = DONATION[config]
    step = jax.jit(step_fns(wrapper)[fn_name], donate_argnums=donate_argnums)
    grads = jax.tree.map(jnp.ones_like, params)
    state = wrapper.init(params)
    # Fresh buffers: donation must not consume the shared `params`.
    carried, other = (grads, params) if fn_name == "update" else (params, grads)
    args = [jax.tree.map(jnp.copy, carried), state, other]
    compiled = step.lower(*args).compile()
    copies, array_copies = count_copies(compiled.as_text())
    memory = compiled.memory_analysis()
    figures = {
        "temp_bytes": memory.temp_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "hlo_copies": copies,
        "hlo_array_copies": array_copies,
    }
    return compiled, args, figures


def time_calls(compiled, args: list) -> float:
    """Runs ``CALLS_PER_ROUND`` chained mini-steps; returns seconds per call.

    Each call's first output replaces its first argument, which may have been
    donated: the (zero) updates stand in for the gradients, which changes no
    cost, and a training step's new params for its params.
    """
    start = time.perf_counter()
    for _ in range(CALLS_PER_ROUND):
        args[0], args[1] = compiled(*args)
    jax.block_until_ready(args[:2])
    return (time.perf_counter() - start) / CALLS_PER_ROUND


def main() -> None:
    params = make_params()
    num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    wrappers = {
        "optax": optax.MultiSteps(optax.adam(1e-3), CALLS_PER_WINDOW),
        "jaxaccum": jaxaccum.MultiSteps(optax.adam(1e-3), CALLS_PER_WINDOW),
    }
    results = {
        "num_params": num_params,
        "inner_optimizer": "adam",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "rounds": ROUNDS,
        "calls_per_round": CALLS_PER_ROUND,
        "configs": {},
    }
    for config in DONATION:
        built = {name: build(w, params, config) for name, w in wrappers.items()}
        for compiled, args, _ in built.values():
            time_calls(compiled, args)  # warm-up
        seconds = {name: [] for name in built}
        for _ in range(ROUNDS):
            for name, (compiled, args, _) in built.items():
                seconds[name].append(time_calls(compiled, args))
        ratios = [
            j / o for j, o in zip(seconds["jaxaccum"], seconds["optax"], strict=True)
        ]
        results["configs"][config] = {
            "time_ratio_jaxaccum_over_optax": statistics.median(ratios),
            "temp_ratio_jaxaccum_over_optax": (
                built["jaxaccum"][2]["temp_bytes"]
                / max(built["optax"][2]["temp_bytes"], 1)
            ),
            **{
                name: {"median_ms": 1e3 * statistics.median(seconds[name]), **fig}
                for name, (_, _, fig) in built.items()
            },
        }

    RESULTS_PATH.parent.mkdir(exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"non-emitting mini-step, adam, {num_params / 1e6:.1f}M float32 params, "
        f"{results['backend']} ({results['cpu']})"
    )
    header = (
        f"{'config':<13} {'library':<9} {'median ms':>9} {'temp KiB':>10} "
        f"{'copies':>6} {'array copies':>12}"
    )
    print(header)
    for config, figures in results["configs"].items():
        for name in wrappers:
            row = figures[name]
            print(
                f"{config:<13} {name:<9} {row['median_ms']:>9.2f} "
                f"{row['temp_bytes'] / 2**10:>10.1f} {row['hlo_copies']:>6} "
                f"{row['hlo_array_copies']:>12}"
            )
        print(
            f"{config:<13} ratio jaxaccum/optax: time "
            f"{figures['time_ratio_jaxaccum_over_optax']:.2f}"
        )
    print(f"wrote {RESULTS_PATH}")


if __name__ == "__main__":
    main()
