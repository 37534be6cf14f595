"""Equinox integration: filter-style accumulation for ``eqx.Module`` models.

An ``eqx.Module`` holds leaves that are not arrays (activation functions,
static ints), so it cannot be differentiated as it is; Equinox's answer is to
differentiate its inexact-array leaves only (``eqx.filter_value_and_grad``).
:func:`filter_value_and_grad` and :func:`filter_grad` do the same over
micro-batches: the model is split with ``eqx.partition(model,
eqx.is_inexact_array)``, its arrays are differentiated by
:func:`jaxaccum.value_and_grad`'s core (strided split, float32 accumulation,
weighted reduction, pad, remat, reports) and the rest is closed over, so the
gradients come back as a pytree like the model with ``None`` where Equinox puts
``None``.

State (``eqx.nn.State``, e.g. BatchNorm's running statistics) named in
``state_argnums`` is carried through the micro-batches in order, as ``N``
sequential training-mode passes leave it: the semantics of the Flax helpers
(see ``jaxaccum.flax``: BatchNorm over the window with ``axis_name=``). PRNG keys
named in ``key_argnums`` are split per micro-batch.

With :class:`jaxaccum.MultiSteps`, the usual Equinox pattern works unchanged:
``optimizer.init(eqx.filter(model, eqx.is_array))``, then
``optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))`` and
``eqx.apply_updates(model, updates)``.
"""

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

try:
    import equinox as eqx
except ImportError as error:  # pragma: no cover - exercised in a core-only venv
    raise ImportError(
        "jaxaccum.equinox needs Equinox, which the core install leaves out: pip "
        'install "jaxaccum[equinox]"'
    ) from error

from jaxaccum._checks import check_accepts_example_mask
from jaxaccum._types import FilterCompareKwargs, FilterKwargs, Fun, Params, PyTree
from jaxaccum._value_and_grad import (
    add_call_parameters,
    grads_only,
    make_accumulated,
)
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import COMPARE_REFUSED, WindowSpec

if TYPE_CHECKING:
    from jaxaccum._diagnose._diagnosis import Diagnosis

__all__ = [
    "filter_assert_grads_match_full_batch",
    "filter_diagnose",
    "filter_grad",
    "filter_value_and_grad",
]


def _on_arrays(fun: Fun, model: Params) -> tuple[Callable, Any]:
    """``fun`` as a function of the model's inexact arrays, and those arrays."""
    arrays, static = eqx.partition(model, eqx.is_inexact_array)

    def on_arrays(arrays: PyTree, *args: PyTree, **kwargs: PyTree) -> PyTree:
        return fun(eqx.combine(arrays, static), *args, **kwargs)

    return on_arrays, arrays


def filter_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    **options: Unpack[FilterKwargs],
) -> Fun:
    """``eqx.filter_value_and_grad`` over micro-batches.

    Differentiates the inexact-array leaves of ``fun``'s first argument (the
    model), as ``eqx.filter_value_and_grad`` does, with the batch split into
    ``N`` strided micro-batches accumulated in one ``jax.lax.scan``
    (:func:`jaxaccum.value_and_grad`, whose options these are). Guide:
    [Equinox](../guides/equinox.md).

    Args:
      fun: ``fun(model, *args, **kwargs)``, returning the loss (or ``(loss,
        aux)`` with ``has_aux``, or ``(loss_sum, weight)`` with
        ``reduction="weighted"``; with ``state_argnums``, that and the new
        state).
      num_microbatches: ``N``; or ``microbatch_size``.
      **options: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch.
      batch_argnums: positional argument(s) of ``fun`` holding the batch.
      key_argnums: positional argument(s) holding PRNG keys, split per micro-batch.
      state_argnums: state ``fun`` updates and returns (an ``eqx.nn.State``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``.
      aux_reduction: how aux leaves combine over micro-batches.
      accum_dtype: dtype float gradients accumulate in (at least).
      pad: pad a batch ``N`` does not divide; ``fun`` gets ``example_mask=``.
      unroll: passed to ``jax.lax.scan``.
      conv_layout: as for :func:`jaxaccum.value_and_grad`.
      remat: ``True`` or a checkpoint policy: ``jax.checkpoint`` the loss.
      report_finite: also return a :class:`jaxaccum.FiniteReport`.
      report_stats: also return a :class:`jaxaccum.WindowStats` (the noise scale).
      masked: ``N`` is a maximum: the call's ``active_microbatches`` says how
        many micro-batches to compute; pass it as an array under ``eqx.filter_jit``.
      loss_scale: the call's ``loss_scale=`` (a :class:`jaxaccum.DynamicLossScale`)
        scales every micro-batch's loss (a :class:`jaxaccum.LossScaleReport`).
      axis_name: the window as a named axis, as for
        :func:`jaxaccum.value_and_grad` (a BatchNorm under the per-example
        ``jax.vmap``: ``eqx.nn.BatchNorm(..., axis_name=("batch", axis_name))``).
      axis_layout: as for :func:`jaxaccum.value_and_grad`.

    Returns:
      ``accumulated(model, *args, **kwargs)`` returning ``(value, grads)``
      (``((value, aux), grads)`` with ``has_aux``), ``grads`` a pytree like the
      model, ``None`` on leaves that are not inexact arrays; with
      ``state_argnums``, ``(that, new_state)``; with ``report_finite`` or
      ``report_stats``, ``(out, report)``. Use it under ``eqx.filter_jit``.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> import jaxaccum.equinox
      >>> model = eqx.nn.MLP(3, 1, width_size=8, depth=2, key=jax.random.key(0))
      >>> def loss(model, x, y):
      ...     return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)
      >>> x, y = jnp.ones((16, 3)), jnp.zeros(16)
      >>> step = eqx.filter_jit(jaxaccum.equinox.filter_value_and_grad(
      ...     loss, num_microbatches=4, batch_argnums=(1, 2)))
      >>> value, grads = step(model, x, y)
      >>> grads.layers[0].weight.shape, grads.activation
      ((8, 3), None)
    """
    accum_options = _options("filter_value_and_grad", num_microbatches, options)
    if accum_options.pad:
        check_accepts_example_mask(fun)

    @functools.wraps(fun)
    def accumulated(model: Params, *args: PyTree, **kwargs: PyTree) -> PyTree:
        on_arrays, arrays = _on_arrays(fun, model)
        return make_accumulated(on_arrays, accum_options)(arrays, *args, **kwargs)

    add_call_parameters(accumulated, fun, accum_options)
    return accumulated


def _options(
    where: str, num_microbatches: int | None, options: FilterKwargs
) -> WindowSpec:
    """The options of an Equinox front end: it differentiates the model."""
    return WindowSpec.create(
        where,
        num_microbatches,
        options,
        FilterKwargs,
        fixed={"argnums": 0},
        refused=SHARD_OPTIONS,
    )


def filter_grad(
    fun: Fun, num_microbatches: int | None = None, **options: Unpack[FilterKwargs]
) -> Fun:
    """``eqx.filter_grad`` over micro-batches: :func:`filter_value_and_grad`'s
    gradients alone (``(grads, aux)`` with ``has_aux``, as ``eqx.filter_grad``
    returns them).

    Args:
      fun: the loss, ``fun(model, *args)``, a mean over the batch it is given.
      num_microbatches: N, the number of micro-batches (or ``microbatch_size``).
      **options: :func:`filter_value_and_grad`'s keyword options, with the
        same meaning.

    Returns:
      A function of ``fun``'s arguments returning the gradient with respect to
      the model's inexact arrays, a pytree shaped like the model.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> import jaxaccum.equinox
      >>> model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
      >>> loss = lambda model, x: jnp.mean(jax.vmap(model)(x))
      >>> grads = jaxaccum.equinox.filter_grad(loss, 2)(model, jnp.ones((4, 3)))
      >>> grads.weight
      Array([[1., 1., 1.]], dtype=float32)
    """
    accum_options = _options("filter_grad", num_microbatches, options)
    value_and_grad_fun = filter_value_and_grad(fun, num_microbatches, **options)
    return grads_only(value_and_grad_fun, accum_options)


def filter_assert_grads_match_full_batch(
    fun: Fun,
    model: PyTree,
    *args: PyTree,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[FilterCompareKwargs],
) -> None:
    """:func:`jaxaccum.testing.assert_grads_match_full_batch` for an Equinox
    loss ``fun(model, *args)``: its inexact-array leaves are compared, named by
    their path in the model (e.g. ``['grads'].layers[0].weight``).

    Args:
      fun: the loss, ``fun(model, *args)``, a mean over the batch it is given.
      model: the Equinox model (any pytree); its inexact arrays are
        differentiated, as ``eqx.filter_value_and_grad`` does.
      *args: the loss's other arguments; the batch is split over them as
        ``batch_argnums`` says (by default the first after the model).
      num_microbatches: N, the number of micro-batches.
      rtol: relative tolerance of the comparison (float32 default).
      atol: absolute tolerance of the comparison.
      **value_and_grad_kwargs: the other keywords of
        :func:`filter_value_and_grad` (``batch_argnums``, ``reduction``, ...).

    Raises:
      AssertionError: naming each leaf whose accumulated value or gradient
        differs from the full batch's beyond the tolerances, with the errors.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> import jaxaccum.equinox
      >>> model = eqx.nn.MLP(3, 1, width_size=8, depth=2, key=jax.random.key(0))
      >>> loss = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
      >>> x = jax.random.normal(jax.random.key(1), (16, 3))
      >>> jaxaccum.equinox.filter_assert_grads_match_full_batch(
      ...     loss, model, x, num_microbatches=4)
    """
    from jaxaccum.testing import assert_grads_match_full_batch

    WindowSpec.check_keywords(
        "filter_assert_grads_match_full_batch",
        value_and_grad_kwargs,
        FilterCompareKwargs,
        fixed=("argnums",),
        refused=COMPARE_REFUSED,
    )

    on_arrays, arrays = _on_arrays(fun, model)
    assert_grads_match_full_batch(
        on_arrays,
        arrays,
        *args,
        num_microbatches=num_microbatches,
        rtol=rtol,
        atol=atol,
        **value_and_grad_kwargs,
    )


def filter_diagnose(
    fun: Fun,
    model: PyTree,
    *args: PyTree,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[FilterCompareKwargs],
) -> "Diagnosis":
    """:func:`jaxaccum.testing.diagnose` for an Equinox loss ``fun(model,
    *args)``: names why accumulation differs from the full batch (BatchNorm,
    a sum where a mean was meant, ...), leaves named by their path in the model.

    Args:
      fun: the loss, ``fun(model, *args)``.
      model: the Equinox model.
      *args: the loss's other arguments, the batch among them.
      num_microbatches: N, the number of micro-batches.
      rtol: relative tolerance under which the results count as equal.
      atol: absolute tolerance under which the results count as equal.
      **value_and_grad_kwargs: the other keywords of
        :func:`filter_value_and_grad`.

    Returns:
      A :class:`jaxaccum.testing.Diagnosis`; ``print`` it for the report.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp
      >>> import jaxaccum.equinox
      >>> model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
      >>> summed = lambda model, x: jnp.sum(jax.vmap(model)(x))  # not a mean
      >>> x = jax.random.normal(jax.random.key(1), (8, 3))
      >>> diagnosis = jaxaccum.equinox.filter_diagnose(summed, model, x,
      ...                                              num_microbatches=4)
      >>> diagnosis.matches
      False
    """
    from jaxaccum.testing import diagnose

    WindowSpec.check_keywords(
        "filter_diagnose",
        value_and_grad_kwargs,
        FilterCompareKwargs,
        fixed=("argnums",),
        refused=COMPARE_REFUSED,
    )

    on_arrays, arrays = _on_arrays(fun, model)
    return diagnose(
        on_arrays,
        arrays,
        *args,
        num_microbatches=num_microbatches,
        rtol=rtol,
        atol=atol,
        **value_and_grad_kwargs,
    )
