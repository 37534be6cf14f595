"""Why an accumulated gradient differs from the full batch: ``testing.diagnose``."""

from collections.abc import Callable
from typing import Any

import chex
import numpy as np
from typing_extensions import Unpack

from jaxaccum._diagnose import _compare
from jaxaccum._diagnose._causes import (
    batch_dependent_cause,
    metadata_cause,
    random_cause,
    scale_cause,
    unexplained_cause,
    weights_cause,
)
from jaxaccum._diagnose._diagnosis import Diagnosis, LeafError
from jaxaccum._diagnose._probes import (
    EXPLAINED,
    example_interaction,
    flat_gradients,
    key_sensitivity,
    least_squares_scale,
    microbatch_weights,
)
from jaxaccum._types import CompareKwargs, Fun, PyTree
from jaxaccum._window._spec import COMPARE_REFUSED, WindowSpec

# Moving one example changes the others' input gradients by ~1e-7 (rounding)
# in a per-example model, by ~1 / micro-batch size behind BatchNorm.
_INTERACTION = 1e-4
# Fitted micro-batch weights this far apart (relative to their mean) are unequal.
_UNEQUAL = 1e-2


def diagnose(
    fun: Fun,
    *args: PyTree,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[CompareKwargs],
) -> Diagnosis:
    """Compares accumulation with the full batch and names why they differ.

    Computes :func:`jaxaccum.value_and_grad` with ``N`` micro-batches and with
    one (the full batch), like
    :func:`jaxaccum.testing.assert_grads_match_full_batch` (a ``masked``
    window with every micro-batch active), and reports the
    largest error of every leaf. When they differ, it names the first
    :class:`Cause` that explains the error, trying ``"random"``,
    ``"loss_scale"``, ``"unequal_weights"`` and ``"batch_dependent"`` (two
    more full-batch gradients) in that order, else ``"unexplained"``. How each
    is detected: [Pitfalls](../guides/pitfalls.md#how-diagnose-finds-the-cause).

    With ``axis_name``, ``fun`` may have collectives over the window: the
    window is ``jaxaccum.value_and_grad(fun, N, axis_name=...)``, and the
    reference and the probes call ``fun`` with the axis bound and the call as
    its one member, ``jax.vmap(fun, axis_name=axis_name, axis_size=1)``, as
    :func:`jaxaccum.testing.assert_grads_match_full_batch` does; a
    ``"batch_dependent"`` cause then names the coupling that bypasses the
    axis.

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      *args: its positional arguments, batch included.
      num_microbatches: ``N``; or pass ``microbatch_size`` in the kwargs.
      rtol: relative tolerance of the comparison.
      atol: absolute tolerance of the comparison.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``argnums``, ``batch_argnums``, ``reduction``,
        ``axis_name``: the window's axis, bound on both sides as above, ...).

    Returns:
      A :class:`Diagnosis`; ``print`` it for the report.

    Raises:
      NameError: ``fun`` has a collective over an axis no ``axis_name``
        binds (a note says to pass it).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def loss(w, x):                # a sum, but reduction="mean"
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> diagnosis = jaxaccum.testing.diagnose(loss, jnp.ones(3), x,
      ...                                       num_microbatches=4)
      >>> diagnosis.matches, [cause.kind for cause in diagnosis.causes]
      (False, ['loss_scale'])
      >>> print(diagnosis)
      N=4 micro-batches do NOT match the full batch (rtol=1e-05, atol=1e-06).
      Gradient error: 0.75 of the full-batch gradient's norm.
        leaf       max abs error  max rel error
        ['value']           1.64           0.75
        ['grads']           1.34           0.75
      Cause (loss_scale): The accumulated gradient is 0.25 times the full-batch
        gradient: 1/N times (N=4). fun returns a sum over its batch, but
        reduction='mean' averages the N micro-batch sums. Use reduction='sum', or
        return a mean (jnp.mean rather than jnp.sum).
    """
    options = WindowSpec.create(
        "diagnose",
        num_microbatches,
        value_and_grad_kwargs,
        CompareKwargs,
        refused=COMPARE_REFUSED,
    )
    accumulated, reference = _compare.accumulated_and_reference(fun, args, options)
    metadata = _compare.metadata_paths({"grads": reference[1]})
    errors = tuple(
        LeafError(*error, rule="max" if error[0] in metadata else "gradient")
        for error in _compare.leaf_errors(
            {"value": accumulated[0], "grads": accumulated[1]},
            {"value": reference[0], "grads": reference[1]},
        )
    )
    num = _compare.num_microbatches(args, options)
    accumulated_grads = flat_gradients(accumulated[1])
    reference_grads = flat_gradients(reference[1])
    error = float(np.linalg.norm(accumulated_grads - reference_grads))
    relative_error = error / max(float(np.linalg.norm(reference_grads)), 1e-30)
    report = _reporter(num, relative_error, errors, rtol, atol)
    if _close(accumulated, reference, rtol, atol):
        return report(matches=True, causes=())
    if metadata and error <= atol + rtol * float(np.linalg.norm(reference_grads)):
        return report(matches=False, causes=(metadata_cause(errors),))

    if options.key_nums:
        change = key_sensitivity(fun, args, reference, options)
        if change > rtol:
            return report(matches=False, causes=(random_cause(change),))

    scale = least_squares_scale(accumulated_grads, reference_grads)
    residual = np.linalg.norm(accumulated_grads - scale * reference_grads)
    if residual <= EXPLAINED * error:
        cause = scale_cause(scale, num, options.reduction)
        return report(matches=False, causes=(cause,), gradient_scale=scale)

    weights = microbatch_weights(fun, args, num, reference_grads, error, options)
    if weights is not None and np.ptp(weights) > _UNEQUAL:
        return report(
            matches=False,
            causes=(weights_cause(weights, options.reduction),),
            gradient_scale=scale,
            microbatch_weights=tuple(float(w) for w in weights),
        )

    interaction = example_interaction(fun, args, options)
    if interaction is not None and interaction > _INTERACTION:
        cause = batch_dependent_cause(interaction, num, args, options)
    else:
        cause = unexplained_cause(interaction, relative_error)
    return report(
        matches=False,
        causes=(cause,),
        gradient_scale=scale,
        microbatch_weights=None if weights is None else tuple(map(float, weights)),
        interaction=interaction,
    )


def _reporter(
    num: int,
    relative_error: float,
    errors: tuple[LeafError, ...],
    rtol: float,
    atol: float,
) -> Callable[..., Diagnosis]:
    """Builds Diagnoses that share the figures every outcome reports."""

    def report(**fields: Any) -> Diagnosis:
        return Diagnosis(
            num_microbatches=num,
            relative_error=relative_error,
            leaf_errors=errors,
            rtol=rtol,
            atol=atol,
            **fields,
        )

    return report


def _close(actual: PyTree, expected: PyTree, rtol: float, atol: float) -> bool:
    try:
        chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True
