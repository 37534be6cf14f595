"""Accumulated vs full-batch results, shared by ``testing`` and ``_diagnose``."""

import jax
import numpy as np

from jaxaccum._precision import _metadata
from jaxaccum._types import Fun, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window._spec import WindowSpec


def leaf_errors(actual: PyTree, expected: PyTree) -> list[tuple[str, float, float]]:
    r"""Per-leaf ``(path, max abs error, relative error)`` of two pytrees.

    The relative error is the max absolute error divided by the leaf's largest
    :math:`|\text{expected}|`: elementwise ratios would explode on entries
    whose expected value is (nearly) zero, such as the gradient of a bias
    followed by BatchNorm.

    Args:
      actual: a pytree of arrays, e.g. the accumulated ``(value, grads)``.
      expected: a pytree of the same structure, e.g. the full batch's.

    Returns:
      One ``(path, max_abs_error, relative_error)`` per leaf, in the trees'
      order, the path as ``jax.tree_util.keystr`` writes it.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxaccum.testing import leaf_errors
      >>> leaf_errors({"w": jnp.array([1.0, 2.5])}, {"w": jnp.array([1.0, 2.0])})
      [("['w']", 0.5, 0.25)]
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
        scale = max(float(np.abs(b).max(initial=0.0)), float(np.finfo(np.float32).tiny))
        errors.append((jax.tree_util.keystr(path), abs_err, abs_err / scale))
    return errors


def metadata_paths(tree: PyTree) -> frozenset[str]:
    """The ``keystr`` paths of the FP8 metadata leaves of ``tree``."""
    return frozenset(
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if _metadata.is_metadata(path, leaf)
    )


def value_and_grads(fun: Fun, args: tuple, options: WindowSpec) -> tuple:
    """Runs ``fun`` accumulated with ``options`` under jit; returns (value,
    grads) alone."""
    result = jax.jit(make_accumulated(fun, options))(*args)
    if options.report_finite:
        result = result[0]
    if options.state_nums:
        result = result[0]
    if options.has_aux:
        return result[0][0], result[1]
    return result


def accumulated_and_reference(
    fun: Fun, args: tuple, options: WindowSpec
) -> tuple[tuple, tuple]:
    """(value, grads) with ``options``' micro-batches and with one, under jit."""
    accumulated = value_and_grads(fun, args, options)
    reference = value_and_grads(fun, args, options.full_batch)
    return accumulated, reference
