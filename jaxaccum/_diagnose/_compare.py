"""Accumulated vs full-batch results, shared by ``testing`` and ``_diagnose``."""

import dataclasses
import functools
import operator

import jax
import numpy as np

from jaxaccum._precision import _metadata
from jaxaccum._types import Fun, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window import _split
from jaxaccum._window._spec import WindowSpec

# What to do when fun has a collective over an axis the check does not bind.
UNBOUND_AXIS = (
    "fun has a collective over a named axis (lax.pmean, lax.all_gather, a "
    "BatchNorm's axis_name): if it is over the window, pass its name as "
    "axis_name=, and the window is compared with the full batch as the "
    "axis's one member."
)


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


def num_microbatches(args: tuple, options: WindowSpec) -> int:
    """The window's ``N`` on the batch in ``args``."""
    batch_size = _split.batch_size_of(
        [(f"args[{i}]", args[i]) for i in options.batch_nums]
    )
    return _split.resolve_num_microbatches(
        batch_size, options.num_microbatches, options.microbatch_size, pad=options.pad
    ).num_microbatches


def value_and_grads(fun: Fun, args: tuple, options: WindowSpec) -> tuple:
    """Runs ``fun`` accumulated with ``options`` under jit; returns (value,
    grads) alone. A ``masked`` window runs with every micro-batch active
    (``active_microbatches=N``): the big batch's gradient."""
    accumulated = jax.jit(make_accumulated(fun, options))
    if options.masked:
        active = num_microbatches(args, options)
        result = accumulated(*args, active_microbatches=active)
    else:
        result = accumulated(*args)
    if options.reports:
        result = result[0]
    if options.state_nums:
        result = result[0]
    if options.has_aux:
        return result[0][0], result[1]
    return result


def on_whole_batch(fun: Fun, options: WindowSpec) -> Fun:
    """``fun`` as the full batch calls it: with ``options.axis_name`` bound
    and the call as the axis's one member (``jax.vmap`` with ``axis_size=1``),
    so a ``pmean`` over the axis is the identity, an ``all_gather`` the
    call's own rows and ``axis_index`` 0 (the Flax guide's big batch);
    ``fun`` itself where the window is no axis."""
    if options.axis_name is None:
        return fun
    axis_name = options.axis_name

    def bound(*args: PyTree, **kwargs: PyTree) -> PyTree:
        call = functools.partial(fun, *args, **kwargs)
        out = jax.vmap(call, axis_name=axis_name, axis_size=1)()
        return jax.tree.map(operator.itemgetter(0), out)

    return bound


def reference_options(options: WindowSpec) -> WindowSpec:
    """``options``' full batch: one micro-batch and no axis, for the function
    :func:`on_whole_batch` returns (which binds the axis itself)."""
    return dataclasses.replace(options.full_batch, axis_name=None)


def reference(fun: Fun, args: tuple, options: WindowSpec) -> tuple:
    """The full batch's (value, grads) under jit: what the window with
    ``options`` must equal."""
    return value_and_grads(
        on_whole_batch(fun, options), args, reference_options(options)
    )


def accumulated_and_reference(
    fun: Fun, args: tuple, options: WindowSpec
) -> tuple[tuple, tuple]:
    """(value, grads) with ``options``' micro-batches and of the full batch
    (:func:`reference`), under jit.

    Raises:
      NameError: ``fun``'s, with a note naming ``axis_name=`` where JAX
        found a collective over an axis that no ``axis_name`` binds.
    """
    try:
        accumulated = value_and_grads(fun, args, options)
    except NameError as error:
        if options.axis_name is None and "axis name" in str(error):
            error.add_note(UNBOUND_AXIS)
        raise
    return accumulated, reference(fun, args, options)
