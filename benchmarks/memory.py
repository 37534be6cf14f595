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
from common import memory, mlp_batch, mlp_loss, mlp_params, write_json
from rich.console import Console
from rich.table import Table

import jaxaccum

# name -> layer sizes (input, hidden..., classes)
MODELS = {
    "mlp-784-512-512-10": (784, 512, 512, 10),
    "mlp-256-1024-1024-10": (256, 1024, 1024, 10),
}


def measure(sizes, batch_size: int, num_microbatches: int) -> dict:
    params = mlp_params(sizes)
    batch = mlp_batch(batch_size, sizes[0], sizes[-1])
    optax_microbatched = optax.microbatching.microbatch(
        jax.grad(mlp_loss),
        argnums=1,
        microbatch_size=batch_size // num_microbatches,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )
    temps = {
        "full_batch": memory(jax.value_and_grad(mlp_loss), params, batch)["temp"],
        "jaxaccum": memory(
            jaxaccum.value_and_grad(mlp_loss, num_microbatches), params, batch
        )["temp"],
        "optax_microbatching": memory(optax_microbatched, params, batch)["temp"],
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
