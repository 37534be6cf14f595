"""The pipeline's front end: :func:`pipeline_value_and_grad`, its options
through the core's, the call's schedule run (its class differentiates the
window), the loss scale and the window's normalisation."""

import functools
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh
from typing_extensions import Unpack

from jaxaccum._pipeline._calls import takes_key
from jaxaccum._pipeline._layout import (
    Prepared,
    like_container,
    like_params,
    prepare,
    refuse_fp8_metadata,
    resolve_mesh,
    unpack_params,
    with_microbatch_count,
)
from jaxaccum._pipeline._run import Raw, Run
from jaxaccum._pipeline._schedules import schedule_on, schedule_type
from jaxaccum._pipeline._spec import PIPELINE_REFUSED, PipelineLayout, PipelineWindow
from jaxaccum._pipeline._stats import probed, window_report
from jaxaccum._precision._loss_scale import loss_scale_report, pop_loss_scale
from jaxaccum._types import (
    Batch,
    Fun,
    Params,
    PipelineKwargs,
    PyTree,
    ScheduleName,
    StageOrder,
)
from jaxaccum._window._aux_plan import AuxPlan
from jaxaccum._window._call_checks import check_differentiable
from jaxaccum._window._conv_layout import window_kernels
from jaxaccum._window._mesh import check_callable_mesh
from jaxaccum._window._window import normalized_value


def _normalize(raw: Raw, prepared: Prepared, options: PipelineWindow):
    """The window's value and aux from its sums, as the core's window
    normalises them (:func:`normalized_value`, :meth:`AuxPlan.finalize`),
    over the ``M D`` micro-batch pieces, in ``loss_fn``'s dtypes; the
    gradients are already the window's (the loss sum was differentiated at
    its share)."""
    num_means = prepared.schedule.num_microbatches * prepared.shards
    own = prepared.shapes.own
    value = normalized_value(options, raw.sums.loss, raw.sums.weight, num_means)
    aux = AuxPlan(options.aux_reduction, own.aux, options.accum_dtype).finalize(
        raw.sums.aux, [], num_means, 0
    )
    return value.astype(own.loss.dtype), aux, raw.grads


def make_pipeline(
    functions: tuple,
    options: PipelineWindow,
    mesh: Mesh | AbstractMesh | None,
    bubble_fill: float = 0.0,
    skip_bubbles: bool = True,
) -> Fun:
    """The step of :func:`pipeline_value_and_grad` for ``options`` (whose
    ``pipeline`` is set); ``functions`` is ``(stage_fn, loss_fn, embed_fn)``;
    bubbles compute on ``bubble_fill`` (tests poison it with NaN); 1F1B's
    bubble slots are skipped by ``lax.cond`` unless ``skip_bubbles`` is False
    (computed on the fill and selected away: the benchmark's comparison)."""
    layout = options.layout
    schedule_type(layout.schedule, layout.repeats)  # fail at construction
    if mesh is not None and options.num_microbatches is not None:
        schedule_on(resolve_mesh(mesh, options), options)

    def step(params: Params, batch: Batch, key: Any = None, **kwargs: PyTree) -> PyTree:
        scale = pop_loss_scale(kwargs, options.loss_scale)
        if kwargs:
            raise TypeError(
                f"The pipelined step got unexpected keyword arguments "
                f"{sorted(kwargs)}: it takes step(params, batch, key=None) "
                "(and loss_scale= where built with loss_scale=True)."
            )
        given, params = params, unpack_params(params)
        refuse_fp8_metadata(params)
        check_differentiable(
            "params",
            params,
            "or pass it in the batch (the step differentiates every leaf of params).",
        )
        if key is not None and not any(map(takes_key, functions)):
            raise TypeError(
                "The step was given a key, but none of stage_fn, loss_fn and "
                "embed_fn takes a keyword argument `key`: it would be unused. "
                "Give the functions that draw random numbers a `key` parameter "
                "(e.g. stage_fn(params, x, key)), or call the step without one."
            )
        check_callable_mesh(mesh)
        device_mesh = resolve_mesh(mesh, options)
        call = with_microbatch_count(options, batch, device_mesh)
        schedule = schedule_on(device_mesh, call)
        prepared = prepare(functions, call, mesh, (params, batch, key), schedule)
        run = Run(prepared, call, bubble_fill, skip_bubbles)
        differentiate = functools.partial(schedule.differentiate, run)
        raw = jax.jit(window_kernels(differentiate, call.conv_layout))(
            params, batch, key, None if scale is None else scale.loss_scale
        )
        value, aux, grads = _normalize(raw, prepared, call)
        grads = like_container(like_params(grads, params, prepared), given)
        result = ((value, aux), grads) if call.has_aux else (value, grads)
        report = window_report(raw, prepared, call)
        if scale is not None:
            assert raw.finite is not None
            return result, loss_scale_report(raw.finite, scale, None, report)
        return (result, report) if probed(call) else result

    return step


def pipeline_value_and_grad(
    stage_fn: Fun,
    loss_fn: Fun,
    num_microbatches: int | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    embed_fn: Fun | None = None,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    repeats: int = 1,
    schedule: ScheduleName = "gpipe",
    stage_order: StageOrder = "model",
    **options: Unpack[PipelineKwargs],
) -> Fun:
    """Returns a pipelined ``step(params, batch, key=None) -> (loss, grads)``.

    ``M`` micro-batches flow through ``S R`` stages; the result is the sequential
    model's ``jax.value_and_grad``. Guide: [Pipeline](../guides/pipeline.md).

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> x``, one stage, given its slice
        of ``stage_params``; keeps ``x``'s structure, shapes and dtypes.
      loss_fn: ``loss_fn(head_params, x, micro_batch) -> loss``, the mean loss
        of the micro-batch (see ``reduction``); ``(loss, aux)`` with ``has_aux``.
      num_microbatches: ``M``; ``M D`` divides the batch; circular GPipe
        (``"gpipe"`` with ``R > 1``) needs ``M >= S``, the others take any ``M``.
      mesh: a mesh with ``stage_axis`` (and ``data_axis``); default: ``jax.set_mesh``.
      embed_fn: ``embed_fn(embed_params, micro_batch) -> x``; None: the batch.
      stage_axis: the mesh axis of size ``S`` the stages are placed on.
      data_axis: a mesh axis the batch is sharded over, or None.
      repeats: ``R``, stages per device (circular GPipe, interleaved 1F1B).
      schedule: a :data:`jaxaccum.ScheduleName`: ``"gpipe"``, ``"1f1b"``
        (interleaved with ``R > 1``), ``"zero-bubble"`` (``repeats=1`` only),
        ``"v-zb"`` or ``"v-half"`` (V-shaped, ``repeats=2``): see the guide.
      stage_order: a :data:`jaxaccum.StageOrder`: ``"model"`` or ``"device"``.
      **options: the keyword options below; the others are refused, with why.

    Keyword Args:
      microbatch_size: rows per micro-batch on each data shard, instead of ``M``.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"`` (as ``value_and_grad``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      aux_reduction: ``"mean"`` or ``"sum"`` over micro-batches and data shards.
      accum_dtype: dtype gradients accumulate in (at least); None: their own.
      remat: ``True`` or a checkpoint policy: the loop saves only stage inputs.
      report_stats: also return a :class:`jaxaccum.WindowStats`.
      report_finite: also return a :class:`jaxaccum.FiniteReport`.
      loss_scale: ``True``: the step takes ``loss_scale=`` (as ``value_and_grad``).
      unroll: passed to ``jax.lax.scan``.
      conv_layout: as for :func:`jaxaccum.value_and_grad` (the stages' loop).
      param_gather: ``"auto"`` or ``"window"``: FSDP parameters gathered once.
      grad_reduce: ``"auto"`` or ``"window"``: gradients reduced once, after.

    Returns:
      ``step``, its ``params = (embed_params, stage_params, head_params)`` (the
      ``S R`` stages stacked on axis 0), returning ``(loss, grads)`` (``((loss,
      aux), grads)`` with ``has_aux``; ``(that, report)`` with a report option).

    Examples:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> mesh = jax.make_mesh((1,), ("stage",))  # one device: S = 1
      >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
      >>> loss_fn = lambda h, x, batch: jnp.mean((x @ h - batch["y"]) ** 2)
      >>> step = jaxaccum.pipeline_value_and_grad(stage_fn, loss_fn, 4, mesh=mesh,
      ...     embed_fn=lambda e, batch: batch["x"] @ e, repeats=2)
      >>> params = (jnp.eye(3), jnp.full((2, 3, 3), 0.5), jnp.ones(3))
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> loss, grads = jax.jit(step)(params, batch)
      >>> def sequential(params, batch):  # the two stages, one after the other
      ...     x = stage_fn(params[1][1], stage_fn(params[1][0], batch["x"] @ params[0]))
      ...     return loss_fn(params[2], x, batch)
      >>> expected = jax.value_and_grad(sequential)(params, batch)
      >>> jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), (loss, grads), expected)
      (True, (True, True, True))
    """
    layout = PipelineLayout(stage_axis, data_axis, repeats, schedule, stage_order)
    accum = PipelineWindow.create(
        "pipeline_value_and_grad",
        num_microbatches,
        options,
        PipelineKwargs,
        fixed={"layout": layout},
        refused=PIPELINE_REFUSED,
    )
    return make_pipeline((stage_fn, loss_fn, embed_fn), accum, mesh)
