"""The pipeline's front end: :func:`pipeline_value_and_grad`, its options
through the core's, autodiff through the ``shard_map``'d loop, the loss
scale and the window's normalisation."""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec
from typing_extensions import Unpack

from jaxaccum._loss_scale import (
    loss_scale_report,
    pop_loss_scale,
    scale_loss,
    tree_finite,
    unscale,
)
from jaxaccum._options import (
    PIPELINE_REFUSED,
    AccumOptions,
    PipelineLayout,
)
from jaxaccum._pipeline._1f1b import run_window
from jaxaccum._pipeline._calls import LossOut, takes_key
from jaxaccum._pipeline._device import Probes, Static
from jaxaccum._pipeline._layout import (
    Prepared,
    check_callable_mesh,
    layout_specs,
    like_container,
    like_params,
    place,
    prepare,
    refuse_fp8_metadata,
    reshape,
    resolve_mesh,
    unpack_params,
    with_microbatch_count,
)
from jaxaccum._pipeline._loop import on_device
from jaxaccum._pipeline._schedule import schedule_on
from jaxaccum._pipeline._stats import make_probes, probed, unshared, window_report
from jaxaccum._types import Batch, Fun, Params, PipelineKwargs, PyTree, ScheduleName
from jaxaccum._value_and_grad import check_differentiable
from jaxaccum._window import (
    AuxPlan,
    accum_dtype_for,
    microbatch_share,
    normalized_value,
)


class _Raw(NamedTuple):
    """The window's sums before normalisation.

    Attributes:
      sums: the :class:`LossOut` summed over micro-batches and devices.
      per_micro: each device's per-micro-batch loss and weight,
        ``(S, D, M)`` (the last stage's device's are the losses).
      grads: the gradient of the loss sum, ``(embed, stages, head)``, the
        stages in their ``(R, S, ...)`` layout, in the accumulation dtype.
      probes: with ``report_stats`` or ``report_finite``, the per-tick
        squared norms, else None.
      share: what the loss sum was multiplied by before the backward pass
        (:func:`_window_share`): ``grads`` is the window's gradient.
      finite: with a loss scale, whether the sums and gradients (unscaled,
        reduced over every stage and data shard) are all finite, else None.
    """

    sums: LossOut
    per_micro: LossOut
    grads: tuple
    probes: Probes | None
    share: jax.Array
    finite: jax.Array | None = None


def _window_share(
    options: AccumOptions, num_means: int, weight: PyTree, dtype: Any = jnp.float32
) -> jax.Array:
    """What the window's loss sum is multiplied by before its backward pass,
    so that every cotangent is the big batch's: the core's
    :func:`microbatch_share` with the whole window as one piece of ``M D``
    means. Every forward pass of a pipelined window runs before its backward
    pass, so a weighted window's total weight ``W`` is known: its share is
    exactly ``1 / W`` however unevenly the weight falls (0 at weight 0). In
    ``dtype``, the loss sum's, at least float32."""
    pieces = 1 if options.reduction == "weighted" else num_means
    return microbatch_share(options, pieces, weight, dtype)


def _laid_out(prepared: Prepared, options: AccumOptions, params, batch, key):
    """``params``, ``batch`` and ``key`` placed on the mesh: the parameters
    laid out for the stage axis in their own dtype, then cast up to the
    accumulation dtype (their gradients accumulate and are reduced in it);
    the batch over the data axis, the key replicated."""
    mesh, schedule = prepared.mesh, prepared.schedule
    specs = layout_specs(prepared, options)
    embed, stages, head = params
    stages = jax.tree.map(
        lambda p, spec: reshape(
            p, (schedule.repeats, schedule.num_stages, *p.shape[1:]), mesh, spec
        ),
        stages,
        specs[1],
    )
    embed, head = (
        jax.tree.map(lambda p, spec: place(p, mesh, spec), tree, tree_specs)
        for tree, tree_specs in ((embed, specs[0]), (head, specs[2]))
    )
    params = jax.tree.map(
        lambda p: p.astype(accum_dtype_for(p.dtype, options.accum_dtype)),
        (embed, stages, head),
    )
    batch = place(batch, mesh, PartitionSpec(options.layout.data_axis))
    return params, batch, place(key, mesh, PartitionSpec())


def _static(prepared: Prepared, options: AccumOptions, bubble_fill: float) -> Static:
    """What either schedule's per-device window is built from."""
    return Static(
        prepared.calls,
        options,
        prepared.schedule,
        prepared.shapes,
        prepared.fsdp_dims,
        bubble_fill,
    )


def _device_spec(options: AccumOptions) -> PartitionSpec:
    """A per-device output's spec: one entry per (stage, data shard)."""
    return PartitionSpec(options.layout.stage_axis, options.layout.data_axis)


def _per_device(prepared: Prepared, options: AccumOptions, window, **specs: Any):
    """``window`` under ``shard_map`` on the step's mesh, manual over the
    pipeline's axes (``specs``: its ``in_specs`` and ``out_specs``)."""
    axes = set(options.layout.manual_axes)
    return jax.shard_map(window, mesh=prepared.mesh, axis_names=axes, **specs)


def _differentiate(
    prepared: Prepared,
    options: AccumOptions,
    bubble_fill: float,
    params: tuple,
    batch: Batch,
    key: Any,
    loss_scale: jax.Array | None = None,
) -> _Raw:
    """GPipe: the pipelined loss sum and its gradient, autodiff through the
    ``shard_map``'d scan (the gradients reduced once, at its boundary). With
    ``loss_scale``, the loss sum is scaled before the backward pass and the
    gradients unscaled after it, in float32."""
    params, batch, key = _laid_out(prepared, options, params, batch, key)
    probes, probe_spec = make_probes(prepared, options, loss_scale)
    window = functools.partial(on_device, _static(prepared, options, bubble_fill))
    run = _per_device(
        prepared,
        options,
        window,
        in_specs=(
            layout_specs(prepared, options),
            probe_spec,
            PartitionSpec(options.layout.data_axis),
            PartitionSpec(),
        ),
        out_specs=(PartitionSpec(), (PartitionSpec(), _device_spec(options))),
    )
    num_means = prepared.schedule.num_microbatches * prepared.shards

    def differentiated(p, q):
        total, (sums, per_micro) = run(p, q, batch, key)
        dtype = jnp.promote_types(jnp.result_type(total), jnp.float32)
        share = _window_share(options, num_means, sums.weight, dtype)
        total = total * share
        total = total if loss_scale is None else scale_loss(total, loss_scale)
        return total, (sums, per_micro, share)

    argnums = (0, 1) if probed(options) else 0
    (_, (sums, per_micro, share)), grads = jax.value_and_grad(
        differentiated, argnums, has_aux=True
    )(params, probes)
    grads, probe_grads = grads if probed(options) else (grads, None)
    raw = _Raw(sums, per_micro, grads, unshared(probe_grads, share), share)
    return raw if loss_scale is None else _unscaled(raw, loss_scale)


def _one_f_one_b(
    prepared: Prepared,
    options: AccumOptions,
    bubble_fill: float,
    skip: bool,
    params: tuple,
    batch: Batch,
    key: Any,
    loss_scale: jax.Array | None = None,
) -> _Raw:
    """1F1B: the window's sums and gradient from :func:`run_window` (each
    micro-batch's backward seeded with its share, times ``loss_scale``;
    the gradients unscaled after, in float32). A weighted window's gradient
    is of the loss sum until here, where it is divided by the total weight,
    as the core's window does."""
    params, batch, key = _laid_out(prepared, options, params, batch, key)
    static = _static(prepared, options, bubble_fill)
    run = _per_device(
        prepared,
        options,
        functools.partial(run_window, static, skip),
        in_specs=(
            layout_specs(prepared, options),
            PartitionSpec(options.layout.data_axis),
            PartitionSpec(),
            PartitionSpec(),
        ),
        out_specs=(
            PartitionSpec(),
            _device_spec(options),
            layout_specs(prepared, options),
            _device_spec(options),
        ),
    )
    sums, per_micro, grads, probes = run(params, batch, key, loss_scale)
    num_means = prepared.schedule.num_microbatches * prepared.shards
    dtype = jnp.promote_types(jnp.result_type(sums.loss), jnp.float32)
    share = _window_share(options, num_means, sums.weight, dtype)
    if options.reduction == "weighted":  # the loss sum's: divided by W
        grads = jax.tree.map(lambda g: (g * share).astype(g.dtype), grads)
    raw = _Raw(sums, per_micro, grads, probes if probed(options) else None, share)
    return raw if loss_scale is None else _unscaled(raw, loss_scale)


def _unscaled(raw: _Raw, loss_scale: jax.Array) -> _Raw:
    """``raw`` with its gradients (in their dtype) divided by the loss scale
    (the probes' squared norms already were, leaf by leaf), and whether the
    window is finite."""
    grads = jax.tree.map(lambda g: unscale(g, loss_scale).astype(g.dtype), raw.grads)
    finite = tree_finite((raw.sums.loss, raw.sums.weight, grads))
    return raw._replace(grads=grads, finite=finite)


def _normalize(raw: _Raw, prepared: Prepared, options: AccumOptions):
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
    options: AccumOptions,
    mesh: Mesh | AbstractMesh | None,
    bubble_fill: float = 0.0,
    skip_bubbles: bool = True,
) -> Fun:
    """The step of :func:`pipeline_value_and_grad` for ``options`` (whose
    ``pipeline`` is set); ``functions`` is ``(stage_fn, loss_fn, embed_fn)``;
    bubbles compute on ``bubble_fill`` (tests poison it with NaN); 1F1B's
    bubble slots are skipped by ``lax.cond`` unless ``skip_bubbles`` is False
    (computed on the fill and selected away: the benchmark's comparison)."""
    if mesh is not None and options.num_microbatches is not None:
        schedule_on(resolve_mesh(mesh, options), options)  # fail at construction

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
        call = with_microbatch_count(options, batch, resolve_mesh(mesh, options))
        prepared = prepare(functions, call, mesh, (params, batch, key))
        differentiate = (
            functools.partial(_one_f_one_b, prepared, call, bubble_fill, skip_bubbles)
            if call.layout.schedule == "1f1b"
            else functools.partial(_differentiate, prepared, call, bubble_fill)
        )
        raw = jax.jit(differentiate)(
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
    **options: Unpack[PipelineKwargs],
) -> Fun:
    """Pipeline parallelism where the accumulation window is the pipeline.

    The batch's ``M`` strided micro-batches (``k``: examples ``k, k + M,
    ...``) flow through ``S R`` stages on the mesh's stage axis (``S``
    devices; stage ``r S + d`` on device ``d``) in one ``lax.scan`` of
    ``M R + S - 1`` ticks, backward by autodiff through it. The result equals
    ``jax.value_and_grad`` of the model run sequentially on the whole batch,
    reduced as :func:`jaxaccum.value_and_grad` does; gradients accumulate in
    ``accum_dtype`` and come back in the parameters' dtypes, shapes and
    shardings. Bubbles compute on masked inputs whose results and gradients
    are selected away (``jnp.where``). In the loop the only collectives are
    ``collective-permute`` s to the next stage's device; gradients are
    reduced once, after it.

    With ``schedule="1f1b"`` (``repeats=1``) the same result comes from one
    ``lax.scan`` of ``M + 2 (S - 1)`` ticks that is itself the backward:
    each tick gives every device a forward slot (micro-batch ``t - d`` on
    device ``d``) and a backward slot (micro-batch ``t - 2 (S - 1) + d``),
    each stage's backward the ``jax.vjp`` of ``stage_fn`` rebuilt from a
    ring of ``min(2 S - 1, M)`` saved stage inputs (with ``remat``) or
    residuals, so the activation memory does not grow with ``M``;
    activations go forward and cotangents back to the neighbouring devices
    only. A bubble's slots are skipped (``lax.cond``) and their results
    never reach the gradients. The schedules, the bubble, memory, FSDP and
    keys: docs/guides/pipeline.md.

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> x``, one stage, given its slice
        of ``stage_params``; keeps ``x``'s structure, shapes and dtypes.
      loss_fn: ``loss_fn(head_params, x, micro_batch) -> loss``: the mean
        loss of the micro-batch (see ``reduction``); ``(loss, aux)`` with
        ``has_aux``.
      num_microbatches: ``M``; ``M D`` must divide the batch. ``M < S`` is
        allowed with ``repeats=1``; ``repeats > 1`` needs ``M >= S``.
      mesh: a mesh with ``stage_axis`` (and ``data_axis``); by default the
        one set with ``jax.set_mesh``.
      embed_fn: ``embed_fn(embed_params, micro_batch) -> x``; None: ``x`` is
        the micro-batch.
      stage_axis: the mesh axis of size ``S`` the stages are placed on.
      data_axis: a mesh axis the batch is sharded over, or None.
      repeats: ``R``, stages per device (circular schedule).
      schedule: ``"gpipe"`` (forward ticks, backward by autodiff; activation
        memory linear in ``M``) or ``"1f1b"`` (one forward and one backward
        per tick; activation memory flat in ``M``; ``repeats=1`` only,
        interleaved 1F1B is not built).
      **options: the keyword options below, :func:`jaxaccum.value_and_grad`'s
        that a pipeline takes; its others are refused, each with why.

    Keyword Args:
      microbatch_size: instead of ``num_microbatches``, rows per micro-batch
        on each data shard: ``M`` is read off each call's batch.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``, as for
        :func:`jaxaccum.value_and_grad`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      aux_reduction: ``"mean"`` or ``"sum"`` of aux over micro-batches and
        data shards.
      accum_dtype: dtype gradients accumulate in (at least); None: their own.
      remat: ``True`` or a checkpoint policy: calls are rematerialised, the
        loop saves only each tick's stage input.
      report_stats: also return a :class:`jaxaccum.WindowStats`, as
        :func:`jaxaccum.shard_value_and_grad` does.
      report_finite: also return a :class:`jaxaccum.FiniteReport`: per
        micro-batch, whether its loss and its gradient (every stage's piece)
        are finite.
      loss_scale: ``True``: the step takes ``loss_scale=`` (the window's
        :class:`jaxaccum.DynamicLossScale`) and multiplies the loss sum by it
        before the backward pass, as :func:`jaxaccum.value_and_grad` does;
        the gradients are unscaled in float32 and the window is finite only if
        every sum and gradient is, over every stage and data shard.
      unroll: passed to ``jax.lax.scan``.
      param_gather: ``"auto"`` or ``"window"`` (the same): parameters sharded
        over ``data_axis`` (FSDP, on an Explicit mesh) are gathered once per
        window, before the loop; ``"microbatch"`` is refused.
      grad_reduce: ``"auto"`` or ``"window"`` (the same): gradients are
        reduced (FSDP leaves reduce-scattered) once, after the loop.

    Returns:
      ``step(params, batch, key=None)``, ``params = (embed_params,
      stage_params, head_params)`` (each leaf of ``stage_params`` stacking the
      ``S R`` stages on axis 0), returning ``(loss, grads)``, ``((loss, aux),
      grads)`` with ``has_aux``, ``(that, stats)`` with ``report_stats``
      (``report_finite``: a ``FiniteReport``), and
      ``(that, report)`` with ``loss_scale``, ``report`` a
      :class:`jaxaccum.LossScaleReport` (holding the stats, if any).
      Given a PRNG ``key``, each function with a ``key`` parameter gets
      ``key=``: micro-batch ``k``'s ``split(key, M)[k]`` (after folding in
      the data shard's index), folded with ``l`` for stage ``l``, ``S R`` for
      ``embed_fn``, ``S R + 1`` for ``loss_fn``: the same on whichever tick or
      device it runs.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> mesh = jax.make_mesh((1,), ("stage",))  # one device: S = 1
      >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
      >>> loss_fn = lambda h, x, batch: jnp.mean((x @ h - batch["y"]) ** 2)
      >>> step = jaxaccum.pipeline_value_and_grad(stage_fn, loss_fn, 4, mesh=mesh,
      ...     embed_fn=lambda e, batch: batch["x"] @ e, repeats=2)
      >>> params = (jnp.eye(3), jnp.full((2, 3, 3), 0.5), jnp.ones(3))
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> loss, grads = jax.jit(step)(params, batch)
      >>> def sequential(params, batch):
      ...     embed, stages, head = params
      ...     x = stage_fn(stages[1], stage_fn(stages[0], batch["x"] @ embed))
      ...     return loss_fn(head, x, batch)
      >>> expected = jax.value_and_grad(sequential)(params, batch)
      >>> jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), (loss, grads), expected)
      (True, (True, True, True))
    """
    layout = PipelineLayout(stage_axis, data_axis, repeats, schedule)
    accum = AccumOptions.create(
        "pipeline_value_and_grad",
        num_microbatches,
        options,
        fixed={"pipeline": layout},
        refused=PIPELINE_REFUSED,
    )
    return make_pipeline((stage_fn, loss_fn, embed_fn), accum, mesh)
