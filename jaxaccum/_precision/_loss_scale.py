"""A float16 loss scale that belongs to the window.

Every micro-batch of a window has its loss multiplied by the same scale, so
the window's gradient sum (float32) is unscaled once; whether the window is
finite is decided once, at its end; a window that is not is skipped whole and
the scale backs off; the scale grows after ``period`` finite windows
(optimizer steps), not micro-batches. :class:`DynamicLossScale` is the state
(jmp's fields and rule), threaded by the caller through
:func:`jaxaccum.value_and_grad` (``loss_scale=True``) or kept by
:class:`jaxaccum.MultiSteps` (``loss_scale=``); :func:`select_if_finite` keeps
what a skipped window must leave unchanged. Guide: [Mixed
precision](../guides/mixed-precision.md).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum._checks import check_scalar
from jaxaccum._types import PyTree


class DynamicLossScale(NamedTuple):
    """A dynamic loss scale: the fields and rule of ``jmp.DynamicLossScale``.

    Build it with :func:`dynamic_loss_scale`; :func:`update_loss_scale` is
    the rule. Every field is a scalar array, so the state jits, checkpoints
    and resumes with the rest of the training state.

    Attributes:
      loss_scale: float32, what each micro-batch's loss is multiplied by.
      counter: int32, finite windows in a row since the scale last changed.
      period: int32, finite windows in a row after which the scale grows.
      factor: float32, what the scale grows by and backs off by.
      min_loss_scale: float32, the floor the scale backs off to.
    """

    loss_scale: jax.Array
    counter: jax.Array
    period: jax.Array
    factor: jax.Array
    min_loss_scale: jax.Array


_DTYPES = DynamicLossScale(jnp.float32, jnp.int32, jnp.int32, jnp.float32, jnp.float32)


def dynamic_loss_scale(
    loss_scale: jax.typing.ArrayLike = 2.0**15,
    *,
    period: jax.typing.ArrayLike = 2000,
    factor: jax.typing.ArrayLike = 2.0,
    min_loss_scale: jax.typing.ArrayLike = 1.0,
) -> DynamicLossScale:
    """Returns the initial :class:`DynamicLossScale` (its counter at 0).

    Args:
      loss_scale: the first window's scale, > 0; a power of two unscales
        exactly. 2**15 is the largest power of two float16 holds.
      period: finite windows in a row after which the scale grows, >= 1.
      factor: what the scale grows by (and backs off by), > 1.
      min_loss_scale: the floor of the scale, from 0 (excluded) to
        ``loss_scale``.

    Returns:
      A :class:`DynamicLossScale` of float32 and int32 scalars.

    Raises:
      TypeError: for a value that is not a real (or, for ``period``,
        integer) scalar, naming it.
      ValueError: for a value out of its range, naming it.

    Examples:
      >>> import jaxaccum
      >>> scale = jaxaccum.dynamic_loss_scale(2.0**15, period=1000)
      >>> float(scale.loss_scale), int(scale.counter), int(scale.period)
      (32768.0, 0, 1000)
    """
    return _checked("", (loss_scale, 0, period, factor, min_loss_scale))


def check_loss_scale(name: str, state: PyTree) -> DynamicLossScale:
    """``state`` checked to be a :class:`DynamicLossScale` of scalars in
    range (``name`` in the messages), in its canonical dtypes."""
    if isinstance(state, LossScaleReport):
        raise TypeError(
            f"{name} was given a LossScaleReport, the window's report; pass "
            f"its loss_scale field (report.loss_scale), the next window's "
            "DynamicLossScale."
        )
    if not isinstance(state, DynamicLossScale):
        raise TypeError(
            f"{name} must be a jaxaccum.DynamicLossScale, e.g. "
            "jaxaccum.dynamic_loss_scale(2.0**15) or the loss_scale of the "
            f"previous window's LossScaleReport; got {type(state).__name__}."
        )
    return _checked(f"{name}.", tuple(state))


_FIELDS = (  # name, integer, low, open_low
    ("loss_scale", False, 0.0, True),
    ("counter", True, 0, False),
    ("period", True, 1, False),
    ("factor", False, 1.0, True),
    ("min_loss_scale", False, 0.0, True),
)


def _checked(prefix: str, values: tuple) -> DynamicLossScale:
    """The fields ``values`` checked (named ``prefix + field``) and cast."""
    for value, (field, integer, low, open_low) in zip(values, _FIELDS, strict=True):
        check_scalar(prefix + field, value, integer=integer, low=low, open_low=open_low)
    scale, floor = values[0], values[4]
    concrete = not any(isinstance(v, jax.core.Tracer) for v in (scale, floor))
    if concrete and float(floor) > float(scale):
        raise ValueError(
            f"{prefix}min_loss_scale={float(floor)!r} is above "
            f"{prefix}loss_scale={float(scale)!r}: the first backoff would "
            "raise the scale. Pass a floor at most the scale."
        )
    return DynamicLossScale(
        *(
            jnp.asarray(value, dtype)
            for value, dtype in zip(values, _DTYPES, strict=True)
        )
    )


def _check_flag(name: str, flag: Any) -> jax.Array:
    flag = jnp.asarray(flag)
    if (flag.dtype, flag.shape) != (jnp.bool_, ()):
        raise TypeError(
            f"{name} must be a boolean scalar (the window's finite flag, "
            f"LossScaleReport.finite), got dtype {flag.dtype} and shape {flag.shape}."
        )
    return flag


def update_loss_scale(
    state: DynamicLossScale, finite: jax.typing.ArrayLike
) -> DynamicLossScale:
    """The next window's scale, after a window that was ``finite`` or not.

    After ``period`` finite windows in a row the scale grows by ``factor``
    (not past float32's largest value); after one that was not finite it backs
    off by ``factor``, floored at ``min_loss_scale``; the counter restarts at
    each change. :func:`jaxaccum.value_and_grad` and
    :class:`jaxaccum.MultiSteps` apply it once per window.

    Args:
      state: the current :class:`DynamicLossScale`.
      finite: bool scalar, whether the window's gradients were all finite.

    Returns:
      The next :class:`DynamicLossScale`.

    Raises:
      TypeError: for a ``state`` that is not a :class:`DynamicLossScale`
        (a :class:`LossScaleReport`: pass its ``loss_scale``).
      ValueError: for a field out of its range, or a floor above the scale.

    Examples:
      >>> import jaxaccum
      >>> scale = jaxaccum.dynamic_loss_scale(8.0, period=2)
      >>> scale = jaxaccum.update_loss_scale(scale, True)
      >>> float(scale.loss_scale), int(scale.counter)
      (8.0, 1)
      >>> float(jaxaccum.update_loss_scale(scale, True).loss_scale)
      16.0
      >>> float(jaxaccum.update_loss_scale(scale, False).loss_scale)
      4.0
    """
    state = check_loss_scale("state", state)
    finite = _check_flag("finite", finite)
    grows = finite & (state.counter >= state.period - 1)
    grown = state.loss_scale * state.factor
    grown = jnp.where(jnp.isfinite(grown), grown, state.loss_scale)
    # A backoff never raises the scale (a traced floor above it is not
    # refused when built).
    backed_off = jnp.minimum(
        jnp.maximum(state.loss_scale / state.factor, state.min_loss_scale),
        state.loss_scale,
    )
    loss_scale = jnp.where(
        finite, jnp.where(grows, grown, state.loss_scale), backed_off
    )
    counter = jnp.where(finite & ~grows, state.counter + 1, 0)
    return state._replace(
        loss_scale=loss_scale.astype(jnp.float32), counter=counter.astype(jnp.int32)
    )


def select_if_finite(
    finite: jax.typing.ArrayLike, updated: PyTree, current: PyTree
) -> PyTree:
    """``updated`` if the window was finite, else ``current``, bitwise.

    A select per leaf (``jnp.where``), no Python control flow, so it works in
    a jitted train step: pass the new and old parameters and optimizer state
    (and any model state the window updated), and a skipped window leaves
    them exactly as they were.

    Args:
      finite: bool scalar, e.g. :attr:`LossScaleReport.finite`.
      updated: the pytree after the update.
      current: the pytree before it; the same structure, shapes and dtypes.

    Returns:
      ``updated`` where ``finite``, else ``current``.

    Raises:
      TypeError: for a ``finite`` that is not a boolean scalar.
      ValueError: for trees of different structures, or a leaf (named) whose
        shape or dtype differs.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> old, new = {"w": jnp.ones(2)}, {"w": jnp.full(2, jnp.nan)}
      >>> jaxaccum.select_if_finite(jnp.bool_(False), new, old)
      {'w': Array([1., 1.], dtype=float32)}
    """
    finite = _check_flag("finite", finite)
    updated_tree: PyTree  # a PyTreeDef, which jaxlib's stubs leave unresolved
    updated_leaves, updated_tree = jax.tree_util.tree_flatten_with_path(updated)
    current_leaves, current_tree = jax.tree.flatten(current)
    if updated_tree != current_tree:
        raise ValueError(
            f"updated has structure {updated_tree} but current has "
            f"{current_tree}; pass the same trees before and after the update."
        )
    for (path, new), old in zip(updated_leaves, current_leaves, strict=True):
        new_spec = (jnp.shape(new), jnp.result_type(new))
        old_spec = (jnp.shape(old), jnp.result_type(old))
        if new_spec != old_spec:
            raise ValueError(
                f"Leaf {jax.tree_util.keystr(path) or '(root)'} has shape "
                f"{new_spec[0]} and dtype {new_spec[1]} in updated but "
                f"{old_spec[0]} and {old_spec[1]} in current; a select keeps "
                "both, so they must match (cast the update to the state's dtype)."
            )
    return optax.tree.where(finite, updated, current)


class LossScaleReport(NamedTuple):
    """A window computed under a loss scale: whether to apply it, the next scale.

    The report of :func:`jaxaccum.value_and_grad` with ``loss_scale=True``.

    Attributes:
      finite: bool scalar, the window's loss and gradient sums all finite
        (decided once, after the last micro-batch): apply the update only
        then, with :func:`select_if_finite`.
      loss_scale: the :class:`DynamicLossScale` of the next window (the rule
        of :func:`update_loss_scale`).
      report: the window's :class:`jaxaccum.FiniteReport` (``report_finite``)
        or :class:`jaxaccum.WindowStats` (``report_stats``), else ``()``.
    """

    finite: jax.Array
    loss_scale: DynamicLossScale
    report: Any = ()


def tree_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite."""
    flags = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def scale_loss(loss: PyTree, loss_scale: jax.Array) -> jax.Array:
    """``loss`` times the scale, in at least float32: a float16 loss is not
    rounded (or overflowed) by the product; the cotangent its backward pass
    starts from is the scale itself."""
    loss = jnp.asarray(loss)
    return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)) * loss_scale


def unscale(tree: PyTree, loss_scale: jax.Array) -> PyTree:
    """``tree`` divided by the scale, in at least float32 (exact for a power
    of two): a float16 gradient's unscaled value may be below float16's range."""

    def unscale_leaf(leaf: PyTree) -> jax.Array:
        leaf = jnp.asarray(leaf)
        return leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32)) / loss_scale

    return jax.tree.map(unscale_leaf, tree)


class WindowLossScale(NamedTuple):
    """The loss scale of :class:`jaxaccum.MultiSteps`, held for a window.

    Attributes:
      scale: the current window's :class:`DynamicLossScale`, fixed while it
        accumulates; the call that closes the window updates it.
      finite: bool scalar, every accepted call of the current window so far
        had a finite gradient (and weight); after the closing call, whether
        the window was applied. Reset lazily, by the next window's first call.
    """

    scale: DynamicLossScale
    finite: jax.Array


def first_window(loss_scale: DynamicLossScale | None) -> Any:
    """A ``MultiStepsState.loss_scale`` before any call: the scale, finite so
    far (``()`` without a scale)."""
    if loss_scale is None:
        return ()
    return WindowLossScale(loss_scale, jnp.array(True))


def after_call(
    state: WindowLossScale,
    call_finite: jax.Array,
    window_start: jax.Array,
    dropped: jax.Array,
    closes: jax.Array,
) -> WindowLossScale:
    """``state`` after one call: its finite flag joined (a new window's first
    call restarts it; a call ``should_skip_update_fn`` dropped leaves it), and
    the scale updated by the call that ``closes`` the window."""
    joined = jnp.where(window_start, call_finite, state.finite & call_finite)
    finite = jnp.where(dropped, state.finite, joined)
    scale = optax.tree.where(
        closes, update_loss_scale(state.scale, finite), state.scale
    )
    return WindowLossScale(scale, finite)


def pop_loss_scale(kwargs: dict, enabled: bool) -> Any:
    """For a function built with ``loss_scale`` (``enabled``), the call's
    loss-scale state, popped from ``kwargs`` and checked; without, a refusal
    if it is passed."""
    if not enabled:
        if "loss_scale" in kwargs:
            raise TypeError(
                "loss_scale was passed to a function built without "
                "loss_scale=True: it would reach fun as a keyword argument and "
                "no micro-batch would be scaled. Build the function with "
                "loss_scale=True."
            )
        return None
    if "loss_scale" not in kwargs:
        raise TypeError(
            "With loss_scale=True, call the accumulated function with the "
            "keyword argument loss_scale: the window's jaxaccum.DynamicLossScale "
            "(jaxaccum.dynamic_loss_scale() at first, then the loss_scale of "
            "the previous window's LossScaleReport)."
        )
    return check_loss_scale("loss_scale", kwargs.pop("loss_scale"))


def loss_scale_report(
    finite: jax.Array, scale: Any, valid: jax.Array | None, report: Any
) -> LossScaleReport:
    """The window's :class:`LossScaleReport`. A window out of range (``valid``
    false, traced) is not finite, and leaves the scale as it was: nothing
    overflowed."""
    next_scale = update_loss_scale(scale, finite)
    if valid is not None:
        finite = finite & valid
        next_scale = jax.tree.map(
            lambda new, old: jnp.where(valid, new, old), next_scale, scale
        )
    return LossScaleReport(finite, next_scale, report)
