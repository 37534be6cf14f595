"""Normalisation shared by the in-step (`value_and_grad`) and across-call
(`MultiSteps`) accumulation paths, so both give the same numbers."""

import jax
import jax.numpy as jnp

from jaxaccum._types import PyTree


def divide_by_total_weight(weighted_sum: PyTree, total_weight: jax.Array) -> PyTree:
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
        # In at least float32: a bfloat16 weight of 160k tokens is 0.25% off.
        wide = jnp.promote_types(jnp.result_type(x), jnp.float32)
        if jnp.issubdtype(safe_weight.dtype, jnp.inexact):
            wide = jnp.promote_types(wide, safe_weight.dtype)
        quotient = (x.astype(wide) / safe_weight.astype(wide)).astype(x.dtype)
        return jnp.where(nonzero, quotient, jnp.zeros_like(quotient))

    return jax.tree.map(divide, weighted_sum)


def masked_sum(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns ``(sum of values where mask, number of True in mask)``.

    The pair a ``reduction="weighted"`` loss returns: for per-token losses and a
    padding mask, ``masked_sum(losses, mask)`` is ``(loss_sum, token_count)``.
    Masked entries are selected away (not multiplied by 0), so a NaN or inf
    computed at a padding position does not leak into the sum. A float mask
    is a weight: the result is ``(sum(values * mask), sum(mask))``.

    Args:
      values: per-example or per-token values, e.g. losses.
      mask: bool (or float weights) broadcastable to ``values``.

    Returns:
      ``(loss_sum, weight)``, float32 scalars for float32 inputs.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> losses = jnp.array([[1.0, 2.0, jnp.nan], [3.0, 4.0, 5.0]])
      >>> mask = jnp.array([[True, True, False], [True, False, False]])
      >>> jaxaccum.masked_sum(losses, mask)
      (Array(6., dtype=float32), Array(3., dtype=float32))
    """
    mask = jnp.broadcast_to(mask, jnp.shape(values))
    weights = mask.astype(jnp.result_type(values, jnp.float32))
    selected = jnp.where(mask != 0, values * weights, jnp.zeros_like(values))
    return jnp.sum(selected), jnp.sum(weights)
