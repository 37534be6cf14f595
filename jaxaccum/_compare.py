"""Accumulated vs full-batch results, shared by ``testing`` and ``_diagnose``."""

from typing import Any

import jax
import numpy as np

from jaxaccum.grad import value_and_grad


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


def value_and_grads(accumulated_fun: Any, args: tuple, kwargs: dict) -> tuple:
    """Runs ``accumulated_fun`` under jit; returns (value, grads) alone."""
    result = jax.jit(accumulated_fun)(*args)
    if kwargs.get("report_finite", False):
        result = result[0]
    if kwargs.get("state_argnums", ()) != ():
        result = result[0]
    if kwargs.get("has_aux", False):
        return result[0][0], result[1]
    return result


def reference_kwargs(value_and_grad_kwargs: dict) -> dict:
    """The kwargs for the one-micro-batch (full-batch) reference."""
    return {
        key: value
        for key, value in value_and_grad_kwargs.items()
        if key != "microbatch_size"
    }


def accumulated_and_reference(
    fun: Any, args: tuple, num_microbatches: int | None, value_and_grad_kwargs: dict
) -> tuple[tuple, tuple]:
    """(value, grads) with ``N`` micro-batches and with one, both under jit."""
    accumulated = value_and_grads(
        value_and_grad(fun, num_microbatches, **value_and_grad_kwargs),
        args,
        value_and_grad_kwargs,
    )
    reference = value_and_grads(
        value_and_grad(fun, 1, **reference_kwargs(value_and_grad_kwargs)),
        args,
        value_and_grad_kwargs,
    )
    return accumulated, reference
