"""Assertions that accumulated gradients equal the single large-batch gradient."""

from typing import Any

import chex
import jax
import numpy as np

from jaxaccum._diagnose import Cause, Diagnosis, diagnose
from jaxaccum.grad import value_and_grad

__all__ = [
    "Cause",
    "Diagnosis",
    "assert_grads_match_full_batch",
    "diagnose",
    "leaf_errors",
]


def leaf_errors(actual: Any, expected: Any) -> list[tuple[str, float, float]]:
    """Per-leaf ``(path, max abs error, relative error)`` of two pytrees.

    The relative error is the max absolute error divided by the leaf's largest
    ``|expected|``: elementwise ratios would explode on entries whose expected
    value is (nearly) zero, such as the gradient of a bias followed by
    BatchNorm.
    """
    errors = []
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual),
        jax.tree.leaves(expected),
        strict=True,
    ):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        abs_err = float(np.abs(a - b).max(initial=0.0))
        scale = max(float(np.abs(b).max(initial=0.0)), np.finfo(np.float32).tiny)
        errors.append((jax.tree_util.keystr(path), abs_err, abs_err / scale))
    return errors


def _value_and_grads(accumulated_fun: Any, args: tuple, kwargs: dict) -> tuple:
    """Runs ``accumulated_fun`` under jit; returns (value, grads) alone."""
    result = jax.jit(accumulated_fun)(*args)
    if kwargs.get("state_argnums", ()) != ():
        result = result[0]
    if kwargs.get("has_aux", False):
        return result[0][0], result[1]
    return result


def _reference_kwargs(value_and_grad_kwargs: dict) -> dict:
    """The kwargs for the one-micro-batch (full-batch) reference."""
    return {
        key: value
        for key, value in value_and_grad_kwargs.items()
        if key != "microbatch_size"
    }


def _accumulated_and_reference(
    fun: Any, args: tuple, num_microbatches: int | None, value_and_grad_kwargs: dict
) -> tuple[tuple, tuple]:
    """(value, grads) with ``N`` micro-batches and with one, both under jit."""
    accumulated = _value_and_grads(
        value_and_grad(fun, num_microbatches, **value_and_grad_kwargs),
        args,
        value_and_grad_kwargs,
    )
    reference = _value_and_grads(
        value_and_grad(fun, 1, **_reference_kwargs(value_and_grad_kwargs)),
        args,
        value_and_grad_kwargs,
    )
    return accumulated, reference


def assert_grads_match_full_batch(
    fun: Any,
    *args: Any,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Any,
) -> None:
    """Asserts that accumulated value and gradients equal the full-batch ones.

    Computes ``jaxaccum.value_and_grad(fun, num_microbatches, **kwargs)`` and the
    same with one micro-batch (exactly ``jax.value_and_grad`` on the whole
    batch), both under ``jax.jit``, and compares values and gradients with
    ``chex.assert_trees_all_close``. Works for every reduction (``"weighted"``
    included) and with ``pad``, ``key_argnums`` and ``state_argnums``; aux
    outputs and new state are not compared.

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      *args: its positional arguments, batch included.
      num_microbatches: ``N``; or pass ``microbatch_size`` in the kwargs.
      rtol: relative tolerance.
      atol: absolute tolerance.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``argnums``, ``batch_argnums``, ``reduction``, ...).

    Raises:
      AssertionError: naming the worst leaf, its max absolute and relative
        error and ``N``, followed by chex's report.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w))
      >>> jaxaccum.testing.assert_grads_match_full_batch(
      ...     loss, jnp.ones(3), jnp.ones((8, 3)), num_microbatches=4)
    """
    accumulated, reference = _accumulated_and_reference(
        fun, args, num_microbatches, value_and_grad_kwargs
    )
    try:
        chex.assert_trees_all_close(accumulated, reference, rtol=rtol, atol=atol)
    except AssertionError as error:
        split = (
            f"num_microbatches={num_microbatches}"
            if num_microbatches is not None
            else f"microbatch_size={value_and_grad_kwargs['microbatch_size']}"
        )
        errors = leaf_errors(
            {"value": accumulated[0], "grads": accumulated[1]},
            {"value": reference[0], "grads": reference[1]},
        )
        lines = [
            f"  {path}: max abs error {abs_err:.3g}, relative error {rel_err:.3g}"
            for path, abs_err, rel_err in sorted(errors, key=lambda e: -e[1])
            if abs_err > atol
        ]
        raise AssertionError(
            f"Accumulated result with {split} does not match the full batch "
            f"(rtol={rtol}, atol={atol}). Leaves that differ:\n"
            + "\n".join(lines)
            + f"\n{error}"
        ) from None
