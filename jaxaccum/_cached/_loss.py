"""The loss, once on the whole batch: its value, and its gradient with
respect to the differentiated arguments and to the encoder's outputs."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._cached._library import accum_dtype_for, aux_pair, checked_loss
from jaxaccum._cached._roles import WholeLoss
from jaxaccum._types import PyTree


class LossGrad(NamedTuple):
    """What the whole-batch loss gives the window.

    Attributes:
      value: the loss.
      aux: its aux output (``None`` without ``has_aux``).
      diff_grads: its gradient with respect to the differentiated arguments
        as the loss uses them directly (a temperature, a bias): counted once.
      cotangents: its gradient with respect to the encoder's outputs, in
        ``accum_dtype`` (at least) for float outputs.
    """

    value: jax.Array
    aux: PyTree
    diff_grads: tuple
    cotangents: PyTree


def loss_and_cotangents(
    loss_at: WholeLoss, diff: tuple, outputs: PyTree, *, has_aux: bool, accum_dtype: Any
) -> LossGrad:
    """The loss and its gradients, at outputs cast up to ``accum_dtype``.

    Float outputs narrower than ``accum_dtype`` reach the loss cast up (their
    values unchanged), so that the loss's backward, and the cotangent kept
    until each micro-batch's pullback, are in ``accum_dtype``.
    """

    def scalar_loss(diff: tuple, outputs: PyTree) -> tuple[jax.Array, PyTree]:
        out = loss_at(diff, outputs)
        value, aux = aux_pair(out, "loss") if has_aux else (out, None)
        return jnp.asarray(checked_loss(value, "loss")), aux

    wide = jax.tree.map(
        lambda x: x.astype(accum_dtype_for(x.dtype, accum_dtype)), outputs
    )
    value, pullback, aux = jax.vjp(scalar_loss, diff, wide, has_aux=True)
    diff_grads, cotangents = pullback(jnp.ones_like(value))
    return LossGrad(value, aux, diff_grads, cotangents)
