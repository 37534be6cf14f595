"""What one micro-batch gives its window: its loss, other outputs and
gradients, differentiated at its share of the window, and whether they are
finite."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._types import Grads, PyTree
from jaxaccum._window._spec import WindowSpec


class MicroOut(NamedTuple):
    """What one micro-batch's loss returns besides the loss (the ``has_aux``
    part of the inner ``jax.value_and_grad``).

    Attributes:
      weight: the weight of ``reduction="weighted"``, else ``()``.
      aux: the aux output of ``fun``, else ``()``.
      new_state: the new value of each ``state_argnums`` argument, a tuple.
    """

    weight: PyTree
    aux: PyTree
    new_state: tuple


class MicroResult(NamedTuple):
    """One micro-batch's loss, its other outputs and its gradients.

    Attributes:
      value: the loss as ``fun`` returned it (a loss sum where weighted).
      out: its other outputs.
      grads: the gradient of the loss at its share of the window (see
        :func:`microbatch_share`), FP8 metadata leaves their new values.
      share: the share (a scalar in :func:`share_dtype` of the loss):
        ``grads`` is the loss's gradient times ``share``.
    """

    value: Any
    out: MicroOut
    grads: Grads
    share: Any


def weighted_pair(loss: PyTree, fun: str) -> tuple[Any, Any]:
    """A weighted reduction's ``(loss_sum, weight)``, as the loss function
    (named ``fun`` in messages) must return it: a pair, the weight a scalar."""
    if not (isinstance(loss, tuple | list) and len(loss) == 2):
        raise TypeError(
            f"With reduction='weighted', {fun} must return (loss_sum, weight) "
            "(with has_aux: ((loss_sum, weight), aux)), where loss_sum sums the "
            "micro-batch's losses and weight counts (or sums the weights of) "
            f"what was summed; got {type(loss).__name__}."
        )
    if jnp.shape(loss[1]) != ():
        raise TypeError(
            f"With reduction='weighted', the weight {fun} returns must be a "
            f"scalar, got shape {jnp.shape(loss[1])}."
        )
    return loss[0], loss[1]


def aux_pair(out: PyTree, fun: str) -> tuple[Any, Any]:
    """``(loss, aux)``, as a function (named ``fun`` in messages) built with
    ``has_aux=True`` must return it: a pair. The aux's leaves come back as
    arrays, as ``jax.value_and_grad(..., has_aux=True)`` returns them (a
    Python number a weakly typed scalar), so every front end reduces the
    same aux."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        if hasattr(out, "shape"):
            got = f"an array of shape {jnp.shape(out)}"
        elif isinstance(out, tuple | list):
            got = f"a {type(out).__name__} of {len(out)}"
        else:
            got = f"a {type(out).__name__}"
        raise TypeError(
            f"With has_aux=True, {fun} must return a pair (loss, aux); got "
            f"{got}. Return (loss, {{}}) for no aux, or build without has_aux."
        )
    return out[0], jax.tree.map(jnp.asarray, out[1])


def checked_loss(loss: Any, fun: str) -> Any:
    """``loss`` as a function (named ``fun`` in messages) must return it to
    be differentiated: a real floating-point scalar (a Python number
    included), as ``jax.value_and_grad`` requires. An integer loss would
    have zero gradients and a complex one its real part's, silently.

    Raises:
      TypeError: for anything else, naming its type (or shape and dtype).
    """
    if isinstance(loss, bool) or not (
        hasattr(loss, "dtype") or isinstance(loss, float | int)
    ):
        raise TypeError(
            f"{fun} must return a scalar loss (a pair (loss, aux) with "
            "has_aux=True; (loss_sum, weight) with reduction='weighted'); "
            f"got a {type(loss).__name__}."
        )
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != ():
        raise TypeError(
            f"{fun} must return a scalar loss, got shape {shape}: reduce it "
            "over its batch (jnp.mean, jnp.sum), as jax.value_and_grad needs."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{fun} must return a float loss, got dtype {dtype}: the gradient "
            "of an integer or bool loss is zero and a complex one's is its real "
            "part's (jax.value_and_grad refuses both). Return a real float loss; "
            "a count such as jnp.sum(y > 0) belongs in aux (has_aux=True)."
        )
    return loss


def share_dtype(loss: Any) -> Any:
    """The dtype a share is taken in: the loss's, at least float32. A share
    rounded below the loss's precision (``1 / 3`` in float32 for a float64
    loss) would move every gradient by that rounding."""
    return jnp.promote_types(jnp.result_type(loss), jnp.float32)


def microbatch_share(
    options: WindowSpec, num_means: Any, weight: PyTree, dtype: Any
) -> PyTree:
    """What one micro-batch's loss is multiplied by before its backward pass,
    so that every cotangent in it is the big batch's for the same examples
    (low-precision formats, FP8's amax histories, see the big batch's ranges).

    ``num_means`` counts the window's micro-batches over every device (those
    computed, for ``masked``). Mean: ``1 / num_means``; sum: 1. Weighted: the
    share ``w_k / W`` is known only once every forward pass has run, so the
    loss sum is divided by ``num_means w_k``, the window's total if the
    micro-batches held equal weight (the big batch's cotangents exactly then,
    within the micro-batches' imbalance otherwise); zero weight, zero share.
    In ``dtype``: every caller passes :func:`share_dtype` of its loss.
    """
    if options.reduction == "sum":
        return jnp.ones((), dtype)
    share = 1 / jnp.asarray(num_means, dtype)
    if options.reduction == "mean":
        return share
    weight = jnp.asarray(weight, dtype)
    safe = jnp.where(weight > 0, weight, 1)
    return lax.stop_gradient(jnp.where(weight > 0, share / safe, 0))


class FiniteReport(NamedTuple):
    """Which micro-batches of a window had a finite loss and gradient.

    Returned by :func:`value_and_grad` with ``report_finite=True``. The flags
    are taken per micro-batch inside the scan, before normalisation, so they
    name the culprit even where the window's result hides it (a window of
    zero total weight returns zeros).

    Attributes:
      microbatch_finite: bool ``(N,)``; entry ``k`` is True when micro-batch
        ``k`` (examples ``k, k + N, ...``) gave a finite loss and gradient.
      finite: bool scalar, all of them: use it to skip the update, e.g. with
        ``jax.lax.cond(report.finite, apply_update, keep, ...)``.
    """

    microbatch_finite: jax.Array
    finite: jax.Array


def all_finite(result: MicroResult) -> jax.Array:
    """Whether one micro-batch's loss and gradient are all finite."""
    leaves = [jnp.asarray(result.value), *jax.tree.leaves(result.grads)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))
