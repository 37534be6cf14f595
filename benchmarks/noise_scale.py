"""What `report_stats=True` (the gradient noise scale) costs a window.

The bench MLP (784-512-512-10, batch 8192, Adam), one window = the gradient
of the batch over N micro-batches + one Adam update, jitted; with and without
`report_stats`. Rounds alternate the two, and each round times CALLS calls of
each; the ratio is taken per round (stats / plain), so machine noise hits both
alike; min / median / max over rounds. Compiled temp memory from
`memory_analysis()`.

Run: python benchmarks/noise_scale.py   (writes benchmarks/results/noise_scale.json)
"""

import timeit

import jax
import optax
from common import spread, write_json

import jaxaccum
from jaxaccum.cli import harness, models

BATCH_SIZE = 8192
NUM_MICROBATCHES = (4, 16)
ROUNDS = 9
CALLS = 5


def window(task, num: int, report_stats: bool):
    optimizer = optax.adam(1e-3)
    step = jaxaccum.value_and_grad(task.loss, num, report_stats=report_stats)

    def grads(params, batch):
        out = step(params, batch)
        return out[0] if report_stats else out

    return harness.window_step(grads, optimizer), optimizer.init(task.params)


def measure(task, batch, num: int) -> dict:
    compiled, temps = {}, {}
    for report_stats in (False, True):
        fun, opt_state = window(task, num, report_stats)
        compiled[report_stats], _ = harness.compile_timed(
            fun, task.params, opt_state, batch
        )
        temps[report_stats] = harness.footprint(compiled[report_stats])[0]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for report_stats in (False, True):

            def call(report_stats=report_stats):
                jax.block_until_ready(
                    compiled[report_stats](task.params, opt_state, batch)
                )

            call()
            seconds[report_stats].append(
                min(timeit.repeat(call, number=1, repeat=CALLS))
            )
    ratios = [s / p for s, p in zip(seconds[True], seconds[False], strict=True)]

    return {
        "plain_ms": spread([s * 1e3 for s in seconds[False]]),
        "stats_ms": spread([s * 1e3 for s in seconds[True]]),
        "time_ratio": spread(ratios),
        "plain_temp_bytes": temps[False],
        "stats_temp_bytes": temps[True],
        "temp_ratio": temps[True] / temps[False],
    }


def main() -> None:
    task = models.mlp_task()
    batch = task.make_batch(jax.random.key(0), BATCH_SIZE)
    results = {}
    for num in NUM_MICROBATCHES:
        results[f"N={num}"] = result = measure(task, batch, num)
        time_ratio = result["time_ratio"]
        print(
            f"N={num}: window {result['plain_ms']['median']:.1f} ms, with stats "
            f"x{time_ratio['median']:.3f} (min {time_ratio['min']:.3f}, max "
            f"{time_ratio['max']:.3f}); temp memory x{result['temp_ratio']:.4f}"
        )
    path = write_json(
        "noise_scale",
        {
            "task": task.name,
            "batch_size": BATCH_SIZE,
            "rounds": ROUNDS,
            "calls_per_round": CALLS,
            "results": results,
        },
    )
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
