"""Shared pieces of the benchmark scripts: models, memory analysis, output."""

import json
import pathlib
import platform
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

RESULTS = pathlib.Path(__file__).parent / "results"


def mlp_params(sizes: Sequence[int], seed: int = 0) -> list:
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b)) / jnp.sqrt(a),
            "b": jnp.zeros((b,)),
        }
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params: list, batch: dict) -> jax.Array:
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def mlp_batch(batch_size: int, features: int, classes: int, seed: int = 1) -> dict:
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, (batch_size, features)),
        "y": jax.random.randint(ky, (batch_size,), 0, classes),
    }


def memory(fun: Callable[..., Any], *args: Any) -> dict[str, int]:
    """Compiled memory of ``jax.jit(fun)(*args)``, from XLA's analysis (bytes)."""
    analysis = jax.jit(fun).lower(*args).compile().memory_analysis()
    return {
        "temp": analysis.temp_size_in_bytes,
        "argument": analysis.argument_size_in_bytes,
        "output": analysis.output_size_in_bytes,
        "alias": analysis.alias_size_in_bytes,
    }


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}, optax {optax.__version__}"
    )


def write_json(name: str, payload: dict) -> pathlib.Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path
