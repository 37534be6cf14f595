"""Blockwise contrastive losses against their B x B formulas: memory and time.

Run: python benchmarks/contrastive_losses.py
(writes benchmarks/results/contrastive_losses.json; about a minute on 2 CPU
cores, most of it running the formula at B = 8192).

For CLIP's loss (``jaxaccum.losses.softmax_contrastive``) and SigLIP's
(``sigmoid_contrastive``) at D = 64, the compiled temporaries
(``memory_analysis().temp_size_in_bytes``) of ``jax.jit(jax.value_and_grad)``
over x, y, the scale (and the bias), blockwise at the default block size and
written as the formula that holds the B x B logits, at B in {1024, 8192,
65536}. B = 65536 is compiled only: the formula's logits alone are 16 GiB.
Where both run, the median time of a step (after a warm-up) beside them.
"""

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
from common import write_json

import jaxaccum
from jaxaccum.cli.harness import compile_timed, footprint, median_seconds
from jaxaccum.losses import DEFAULT_BLOCK_SIZE

DIM = 64
SCALE, BIAS = 10.0, -10.0


def _softmax_formula(x, y, scale, bias):
    del bias
    logits = scale * x @ y.T
    diagonal = jnp.diagonal(logits)
    rows = jax.nn.logsumexp(logits, axis=1) - diagonal
    columns = jax.nn.logsumexp(logits, axis=0) - diagonal
    return (jnp.mean(rows) + jnp.mean(columns)) / 2


def _sigmoid_formula(x, y, scale, bias):
    labels = 2 * jnp.eye(x.shape[0]) - 1
    logits = scale * x @ y.T + bias
    return -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / x.shape[0]


def _softmax_blockwise(x, y, scale, bias):
    del bias
    return jaxaccum.losses.softmax_contrastive(x, y, scale)


LOSSES: dict[str, tuple[Callable, Callable]] = {
    "softmax_contrastive": (_softmax_blockwise, _softmax_formula),
    "sigmoid_contrastive": (jaxaccum.losses.sigmoid_contrastive, _sigmoid_formula),
}


def _step(loss: Callable) -> Callable:
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def measure(name: str, batch_size: int, run: bool, repeats: int) -> dict:
    blockwise, formula = LOSSES[name]
    keys = jax.random.split(jax.random.key(batch_size), 2)
    x, y = (jax.random.normal(key, (batch_size, DIM)) for key in keys)
    x, y = (a / jnp.linalg.norm(a, axis=1, keepdims=True) for a in (x, y))
    args = (x, y, jnp.float32(SCALE), jnp.float32(BIAS))
    if not run:  # shapes only: nothing the size of the logits is allocated
        args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    row: dict = {"loss": name, "batch_size": batch_size, "dim": DIM}
    row["block_size"] = DEFAULT_BLOCK_SIZE
    for contender, loss in (("blockwise", blockwise), ("formula", formula)):
        compiled, seconds = compile_timed(_step(loss), *args)
        row[f"{contender}_temp_bytes"] = footprint(compiled)[0]
        row[f"{contender}_compile_seconds"] = seconds
        row[f"{contender}_step_seconds"] = (
            median_seconds(lambda compiled=compiled: compiled(*args), repeats)
            if run
            else None
        )
    row["formula_over_blockwise_temp"] = (
        row["formula_temp_bytes"] / row["blockwise_temp_bytes"]
    )
    row["logits_bytes"] = batch_size**2 * 4
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-sizes", type=int, nargs="*", default=[1024, 8192])
    parser.add_argument("--compile-sizes", type=int, nargs="*", default=[65536])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = [
        measure(name, batch_size, run, args.repeats)
        for name in LOSSES
        for sizes, run in ((args.run_sizes, True), (args.compile_sizes, False))
        for batch_size in sizes
    ]
    for row in rows:
        step = row["blockwise_step_seconds"]
        timing = (
            f", step {step * 1e3:.0f} ms vs {row['formula_step_seconds'] * 1e3:.0f} ms"
            if step is not None
            else " (compiled only)"
        )
        print(
            f"{row['loss']:>20} B={row['batch_size']:>6}: temporaries "
            f"{row['blockwise_temp_bytes'] / 2**20:8.1f} MiB blockwise, "
            f"{row['formula_temp_bytes'] / 2**20:8.1f} MiB formula "
            f"({row['formula_over_blockwise_temp']:.1f}x){timing}"
        )
    path = write_json("contrastive_losses", {"dim": DIM, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
