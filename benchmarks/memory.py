"""Compiled temp memory: jaxaccum vs full batch vs optax.microbatching.

Run: python benchmarks/memory.py   (writes benchmarks/results/memory.json)

For an MLP at batch 8192 split into N=16 micro-batches, compares the compiled
temporary memory (``memory_analysis().temp_size_in_bytes``) of

* the full batch: ``jax.value_and_grad(loss)``;
* ``jaxaccum.value_and_grad(loss, num_microbatches=16)``;
* ``optax.microbatching.microbatch(jax.grad(loss), ...)`` at the same
  micro-batch size (it materialises the micro-batched copy of the batch).
"""

import argparse

import jax
import optax
from common import write_json
from rich.console import Console
from rich.table import Table

import jaxaccum
from jaxaccum.cli import models
from jaxaccum.cli.harness import footprint

# name -> layer sizes (input, hidden..., classes)
MODELS = {
    "mlp-784-512-512-10": (784, 512, 512, 10),
    "mlp-256-1024-1024-10": (256, 1024, 1024, 10),
}


def temp_bytes(fun, *args) -> int:
    return footprint(jax.jit(fun).lower(*args).compile())[0]


def measure(sizes, batch_size: int, num_microbatches: int) -> dict:
    task = models.mlp_task(sizes[0], sizes[1:-1], sizes[-1])
    batch = task.make_batch(jax.random.key(0), batch_size)
    optax_microbatched = optax.microbatching.microbatch(
        jax.grad(task.loss),
        argnums=1,
        microbatch_size=batch_size // num_microbatches,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )
    temps = {
        "full_batch": temp_bytes(jax.value_and_grad(task.loss), task.params, batch),
        "jaxaccum": temp_bytes(
            jaxaccum.value_and_grad(task.loss, num_microbatches), task.params, batch
        ),
        "optax_microbatching": temp_bytes(optax_microbatched, task.params, batch),
    }
    return {
        "temp_bytes": temps,
        "jaxaccum_over_full_batch": temps["jaxaccum"] / temps["full_batch"],
        "jaxaccum_over_optax_microbatching": temps["jaxaccum"]
        / temps["optax_microbatching"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--num-microbatches", type=int, default=16)
    args = parser.parse_args()
    results = {
        name: measure(sizes, args.batch_size, args.num_microbatches)
        for name, sizes in MODELS.items()
    }
    table = Table(
        title=f"Compiled temp memory, batch {args.batch_size}, "
        f"N={args.num_microbatches}"
    )
    for column in (
        "model",
        "full batch",
        "jaxaccum",
        "optax.microbatching",
        "jaxaccum / full",
        "jaxaccum / optax",
    ):
        table.add_column(column, justify="right")
    for name, result in results.items():
        temps = result["temp_bytes"]
        table.add_row(
            name,
            *(f"{temps[key] / 2**20:.1f} MiB" for key in temps),
            f"{result['jaxaccum_over_full_batch']:.3f}x",
            f"{result['jaxaccum_over_optax_microbatching']:.3f}x",
        )
    Console().print(table)
    path = write_json(
        "memory",
        {
            "batch_size": args.batch_size,
            "num_microbatches": args.num_microbatches,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
