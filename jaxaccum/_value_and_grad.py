"""In-step accumulation: ``value_and_grad`` over micro-batches in one ``lax.scan``."""

import functools
import inspect
import typing

import jax
import jax.numpy as jnp
from typing_extensions import Unpack

from jaxaccum._axis._window import axis_window
from jaxaccum._checks import check_accepts_example_mask
from jaxaccum._precision._loss_scale import pop_loss_scale, select_if_finite
from jaxaccum._types import AccumKwargs, Fun, PyTree
from jaxaccum._window import _split
from jaxaccum._window._call_checks import (
    check_active_microbatches,
    check_arg_count,
    check_differentiable_args,
    pop_active_microbatches,
)
from jaxaccum._window._conv_layout import window_kernels
from jaxaccum._window._loop import run_scan, run_single
from jaxaccum._window._microbatch import micro_value_and_grad, window_inputs
from jaxaccum._window._packaging import package
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import WindowSpec


def value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    **options: Unpack[AccumKwargs],
) -> Fun:
    """Returns a function computing ``fun``'s value and gradient by micro-batches.

    Equal to ``jax.value_and_grad(fun)`` on the whole batch, one micro-batch at
    a time in one ``jax.lax.scan``. Guide: [In-step](../guides/in-step.md).

    Args:
      fun: the loss, ``fun(*args, **kwargs)``: a scalar (``(loss, aux)`` with
        ``has_aux``; ``(loss_sum, weight)`` with ``reduction="weighted"``).
      num_microbatches: ``N``, dividing the batch (unless ``pad``), or None.
      **options: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch, instead of ``N``.
      argnums: positional argument(s) to differentiate; their leaves are floats.
      batch_argnums: positional argument(s) holding the batch, split on axis 0.
      key_argnums: positional argument(s) holding PRNG keys, split per micro-batch.
      state_argnums: positional argument(s) of state ``fun`` returns updated,
        ``(out, new_state)``; carried in order, not differentiated.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: ``fun``'s loss over its batch: ``"mean"``, ``"sum"`` or
        ``"weighted"`` (``sum(loss_sum) / sum(weight)``; 0 at weight 0).
      aux_reduction: ``"mean"``, ``"sum"``, ``"stack"``, ``"concat"`` or
        ``"last"``, or a pytree prefix of the aux output mapping leaves to them.
      accum_dtype: a float dtype gradients sum in (at least), or ``None``.
      pad: pad a batch that ``N`` does not divide; ``fun`` then takes
        ``example_mask=``, and ``reduction`` is ``"weighted"`` or ``"sum"``.
      unroll: passed to ``jax.lax.scan``.
      conv_layout: ``"auto"`` (CPU: the loop's convolutions in the fast layout).
      remat: ``True`` or a checkpoint policy: ``jax.checkpoint`` the loss.
      report_finite: also return a :class:`FiniteReport`.
      report_stats: also return a :class:`WindowStats` (the noise scale).
      masked: ``N`` is a maximum: the call's ``active_microbatches`` (traced
        under ``jit``) says how many micro-batches one program computes.
      loss_scale: the call's ``loss_scale=`` (a :class:`DynamicLossScale`)
        scales every micro-batch's loss ([guide](../guides/mixed-precision.md)).
      axis_name: ``fun``'s collectives over it meet across the micro-batches:
        the window is ``jax.vmap(fun, axis_name=axis_name)`` over them.
      axis_layout: micro-batch ``k``'s rows: ``"strided"`` (``k, k + N, ...``)
        or ``"contiguous"`` (block ``k``, as data parallelism lays out devices).

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``
      (``((value, aux), grads)`` with ``has_aux``), ``grads`` like
      ``args[argnums]``; with ``state_argnums``, ``(that, new_state)``; with
      a report option, ``(all that, report)``.

    Raises:
      TypeError: for an unknown or ill-typed option or non-float ``argnums``.
      ValueError: for an option out of range or a batch ``N`` does not divide.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def loss(params, batch):
      ...     return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> step = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))
      >>> step(jnp.ones(3), batch)
      (Array(9., dtype=float32), Array([6., 6., 6.], dtype=float32))
    """
    return make_accumulated(
        fun,
        WindowSpec.create(
            "value_and_grad",
            num_microbatches,
            options,
            AccumKwargs,
            refused=SHARD_OPTIONS,
        ),
    )


def grad(
    fun: Fun, num_microbatches: int | None = None, **options: Unpack[AccumKwargs]
) -> Fun:
    """Like :func:`value_and_grad` but returns only the gradient.

    With ``has_aux=True`` returns ``(grads, aux)``, as ``jax.grad`` does; with
    ``state_argnums``, ``(that, new_state)``; with ``report_finite``
    (``report_stats``, ``loss_scale``), all that and the :class:`FiniteReport`
    (:class:`WindowStats`, :class:`LossScaleReport`).

    Args:
      fun: the loss, as for :func:`value_and_grad`: a scalar mean (or sum, or
        ``(sum, weight)``) over the examples of the batch it is given.
      num_microbatches: N, the number of micro-batches the batch is split into
        (or give ``microbatch_size``).
      **options: :func:`value_and_grad`'s keyword options, with the same
        meaning (``microbatch_size``, ``argnums``, ``batch_argnums``,
        ``has_aux``, ``reduction``, ...).

    Returns:
      A function of ``fun``'s arguments that returns the gradient of the whole
      batch's loss with respect to ``argnums``, computed one micro-batch at a
      time in one ``jax.lax.scan``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> jaxaccum.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.ones((4, 2)))
      Array([1., 1.], dtype=float32)
    """
    accum_options = WindowSpec.create(
        "grad", num_microbatches, options, AccumKwargs, refused=SHARD_OPTIONS
    )
    return grads_only(make_accumulated(fun, accum_options), accum_options)


def grads_only(value_and_grad_fun: Fun, options: WindowSpec) -> Fun:
    """``value_and_grad_fun`` returning what ``jax.grad`` would: the gradients
    (``(grads, aux)`` with ``has_aux``), then the new state and the report."""

    def only_grads(out):
        result, new_state = out if options.state_nums else (out, None)
        value_or_pair, grads = result
        grads = (grads, value_or_pair[1]) if options.has_aux else grads
        return (grads, new_state) if options.state_nums else grads

    @functools.wraps(value_and_grad_fun)
    def grad_fun(*args: PyTree, **call_kwargs: PyTree) -> PyTree:
        out = value_and_grad_fun(*args, **call_kwargs)
        if options.reports:
            return only_grads(out[0]), out[1]
        return only_grads(out)

    return grad_fun


def make_accumulated(fun: Fun, options: WindowSpec) -> Fun:
    """``fun`` accumulated as ``options`` say: the core of every front end.

    With ``options.data_axes`` (manual mesh axes the batch is split over, inside
    ``shard_map``), each device accumulates the sums of its own rows and they
    are all-reduced once, after the micro-batch loop; parameters and keys are
    prepared per device.
    """
    if options.pad:
        check_accepts_example_mask(fun)

    @functools.wraps(fun)
    def accumulated(*args: PyTree, **kwargs: PyTree) -> PyTree:
        active = pop_active_microbatches(kwargs, options)
        scale = pop_loss_scale(kwargs, options.loss_scale)
        check_arg_count(args, options)
        labelled_batches = [(f"args[{i}]", args[i]) for i in options.batch_nums]
        split = _split.resolve_num_microbatches(
            _split.batch_size_of(labelled_batches),
            options.num_microbatches,
            options.microbatch_size,
            pad=options.pad,
        )
        valid = None
        if active is not None:
            valid = check_active_microbatches(active, split.num_microbatches)
            active = jnp.asarray(active, jnp.int32)
        if split.num_microbatches > 1:
            _split.check_sharded_split(
                labelled_batches, split.padded_size, split.num_microbatches
            )
        check_differentiable_args(args, options.diff_nums)
        loss_scale = None if scale is None else scale.loss_scale
        micro = micro_value_and_grad(fun, args, kwargs, options, loss_scale)
        inputs = window_inputs(args, options, split, active)._replace(
            loss_scale=loss_scale
        )
        if split.num_microbatches == 1:
            out = run_single(micro, inputs, options, split)
        else:  # the loop's convolutions rewritten after the checks above ran
            loop = functools.partial(run_scan, micro, options=options, split=split)
            out = window_kernels(loop, options.conv_layout)(inputs)
        if scale is not None and options.state_nums:
            # A window the scale skips leaves the carried state as it was,
            # on every front end that writes it back (NNX in place).
            finite = typing.cast(jax.Array, out.result.finite)
            kept = select_if_finite(finite, out.new_state, inputs.state)
            out = out._replace(new_state=kept)
        return package(out, options, valid, scale)

    add_call_parameters(accumulated, fun, options)
    if options.axis_name is not None:
        axis = functools.wraps(fun)(axis_window(fun, options, accumulated))
        return window_kernels(axis, options.conv_layout)
    return accumulated


def add_call_parameters(accumulated: Fun, fun: Fun, options: WindowSpec) -> None:
    """Gives ``accumulated`` ``fun``'s signature plus the keyword-only
    arguments ``options`` make it take per call (``active_microbatches``
    with ``masked``, ``loss_scale`` with ``loss_scale``), so that wrappers
    which bind the signature (``eqx.filter_jit``) accept them;
    ``functools.wraps`` alone would give it ``fun``'s, without them."""
    names = {"active_microbatches": options.masked, "loss_scale": options.loss_scale}
    wanted = [name for name, taken in names.items() if taken]
    if not wanted:
        return
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):  # no signature to read (a C function)
        return
    parameters = list(signature.parameters.values())
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    parameters[at:at] = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)
        for name in wanted
        if name not in signature.parameters
    ]
    accumulated.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters
    )
