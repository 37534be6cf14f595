"""Losses of every shape ``jaxaccum plan`` takes, for tests/test_cli.py.

Importable as ``cli_losses`` (pytest puts tests/ on ``sys.path``); the CLI
names them ``cli_losses:<function>``.
"""

import jax
import jax.numpy as jnp


def params() -> dict:
    return {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}


def _predictions(params: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w"]).mean(axis=-1)


def loss_with_aux(params: dict, batch: dict) -> tuple:
    """``(loss, aux)``: use ``--has-aux``."""
    errors = _predictions(params, batch["x"]) - batch["y"]
    return jnp.mean(errors**2), {"max_error": jnp.max(jnp.abs(errors))}


def weighted_loss(params: dict, batch: dict) -> tuple:
    """``(loss_sum, weight)`` over the unmasked examples: ``--reduction weighted``."""
    errors = (_predictions(params, batch["x"]) - batch["y"]) ** 2
    return jnp.sum(errors * batch["mask"]), jnp.sum(batch["mask"])


def loss_of_x_and_y(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """Two batch arguments: ``--batch-argnums 1,2``."""
    return jnp.mean((_predictions(params, x) - y) ** 2)


def dropout_loss(params: dict, batch: dict, key: jax.Array) -> jax.Array:
    """A PRNG key argument (dropout): ``--key-argnums 2``."""
    keep = jax.random.bernoulli(key, 0.9, batch["x"].shape)
    x = jnp.where(keep, batch["x"] / 0.9, 0.0)
    return jnp.mean((_predictions(params, x) - batch["y"]) ** 2)


def raises_bare_error(params: dict, batch: dict) -> jax.Array:
    """Raises ``ValueError()``, with no message."""
    raise ValueError()


NOT_A_FUNCTION = 3  # LOSS must name a function
