"""Normalisation shared by the in-step (`value_and_grad`) and across-call
(`MultiSteps`) accumulation paths, so both give the same numbers."""

from typing import Any

import jax
import jax.numpy as jnp


def divide_by_total_weight(weighted_sum: Any, total_weight: jax.Array) -> Any:
    """Returns ``weighted_sum / total_weight`` leaf by leaf, or zeros if it is 0.

    This is the token-exact mean of a window: ``sum_k(w_k * g_k) / sum_k(w_k)``.
    A window whose total weight is zero (every token masked) yields exact zeros,
    never NaN, so an optimizer fed with it does not move.

    Args:
      weighted_sum: pytree of arrays, the sum of weighted contributions.
      total_weight: scalar, the sum of the weights.

    Returns:
      A pytree like ``weighted_sum`` with the same dtypes.
    """
    total_weight = jnp.asarray(total_weight)
    nonzero = total_weight != 0
    safe_weight = jnp.where(nonzero, total_weight, jnp.ones_like(total_weight))

    def divide(x):
        quotient = (x / safe_weight.astype(x.dtype)).astype(x.dtype)
        return jnp.where(nonzero, quotient, jnp.zeros_like(quotient))

    return jax.tree.map(divide, weighted_sum)
