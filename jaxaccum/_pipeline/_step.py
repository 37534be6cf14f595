"""The pipeline's front end: :func:`pipeline_value_and_grad`, its options
through the core's, autodiff through the ``shard_map``'d loop, the loss
scale and the window's normalisation."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxaccum import _metadata, _split
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
    options_signature,
)
from jaxaccum._pipeline._calls import LossOut, takes_key
from jaxaccum._pipeline._layout import (
    Prepared,
    check_callable_mesh,
    explicit,
    layout_specs,
    place,
    prepare,
    reshape,
    resolve_mesh,
    with_microbatch_count,
)
from jaxaccum._pipeline._loop import Probes, on_device
from jaxaccum._pipeline._schedule import schedule_on
from jaxaccum._pipeline._stats import pipeline_stats
from jaxaccum._value_and_grad import check_differentiable
from jaxaccum._window import (
    AuxPlan,
    FiniteReport,
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
    options: AccumOptions, num_means: int, weight: Any, dtype: Any = jnp.float32
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


def _probed(options: AccumOptions) -> bool:
    """Whether the window probes each micro-batch's gradient (its squared
    norm, and so whether it is finite)."""
    return options.report_stats or options.report_finite


def _probes(
    prepared: Prepared, options: AccumOptions, loss_scale: jax.Array | None
) -> tuple[Probes | None, PartitionSpec | None]:
    """With ``report_stats`` or ``report_finite``, the :class:`Probes` and
    their spec. Their values are what each piece's gradient is divided by
    before it is squared: the loss scale, or 1."""
    if not _probed(options):
        return None, None
    schedule = prepared.schedule
    devices = (schedule.num_stages, prepared.shards)
    divisor = jnp.float32(1) if loss_scale is None else loss_scale
    divisor = jnp.asarray(divisor, jnp.float32)
    per_micro = jnp.full((*devices, schedule.num_microbatches), divisor)
    per_tick = jnp.full((*devices, schedule.num_ticks), divisor)
    spec = PartitionSpec(options.layout.stage_axis, options.layout.data_axis)
    return place(Probes(per_micro, per_tick, per_micro), prepared.mesh, spec), spec


def _differentiate(
    prepared: Prepared,
    options: AccumOptions,
    bubble_fill: float,
    params: tuple,
    batch: Any,
    key: Any,
    loss_scale: jax.Array | None = None,
) -> _Raw:
    """The pipelined loss sum and its gradient: autodiff through the
    ``shard_map``'d scan. The parameters are laid out for the stage axis in
    their own dtype, then cast up to the accumulation dtype, so their
    gradients accumulate and are reduced (once, at the ``shard_map``'s
    boundary) in it. With ``loss_scale``, the loss sum is scaled before the
    backward pass and the gradients unscaled after it, in float32."""
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
    embed, stages, head = jax.tree.map(
        lambda p: p.astype(accum_dtype_for(p.dtype, options.accum_dtype)),
        (embed, stages, head),
    )
    batch = place(batch, mesh, PartitionSpec(options.layout.data_axis))
    key = place(key, mesh, PartitionSpec())
    probes, probe_spec = _probes(prepared, options, loss_scale)
    window = functools.partial(
        on_device,
        prepared.calls,
        options,
        schedule,
        prepared.shapes,
        prepared.fsdp_dims,
        bubble_fill,
    )
    run = jax.shard_map(
        window,
        mesh=mesh,
        in_specs=(
            specs,
            probe_spec,
            PartitionSpec(options.layout.data_axis),
            PartitionSpec(),
        ),
        out_specs=(
            PartitionSpec(),
            (
                PartitionSpec(),
                PartitionSpec(options.layout.stage_axis, options.layout.data_axis),
            ),
        ),
        axis_names=set(options.layout.manual_axes),
    )

    num_means = schedule.num_microbatches * prepared.shards

    def differentiated(p, q):
        total, (sums, per_micro) = run(p, q, batch, key)
        dtype = jnp.promote_types(jnp.result_type(total), jnp.float32)
        share = _window_share(options, num_means, sums.weight, dtype)
        total = total * share
        total = total if loss_scale is None else scale_loss(total, loss_scale)
        return total, (sums, per_micro, share)

    argnums = (0, 1) if _probed(options) else 0
    (_, (sums, per_micro, share)), grads = jax.value_and_grad(
        differentiated, argnums, has_aux=True
    )((embed, stages, head), probes)
    grads, probe_grads = grads if _probed(options) else (grads, None)
    raw = _Raw(sums, per_micro, grads, _unshared(probe_grads, share), share)
    return raw if loss_scale is None else _unscaled(raw, loss_scale)


def _unshared(probes: Probes | None, share: jax.Array) -> Probes | None:
    """The probes' squared norms of the loss's own gradient: divided by the
    share twice (not by its square, which underflows sooner)."""
    positive = share > 0
    safe = jnp.where(positive, share, 1)
    return jax.tree.map(lambda q: jnp.where(positive, q / safe / safe, 0), probes)


def _unscaled(raw: _Raw, loss_scale: jax.Array) -> _Raw:
    """``raw`` with its gradients (in their dtype) divided by the loss scale
    (the probes' squared norms already were, leaf by leaf), and whether the
    window is finite."""
    grads = jax.tree.map(lambda g: unscale(g, loss_scale).astype(g.dtype), raw.grads)
    finite = tree_finite((raw.sums.loss, raw.sums.weight, grads))
    return raw._replace(grads=grads, finite=finite)


def _like_params(grads: tuple, params: tuple, prepared: Prepared) -> tuple:
    """Gradients in the parameters' dtypes, shapes (the stages back from
    their ``(R, S, ...)`` layout) and, on an Explicit mesh, shardings: a
    parameter's own, else the pipeline's (stages over the stage axis)."""
    mesh = prepared.mesh
    stage_spec = PartitionSpec(prepared.stage_axis)

    def like(grad: jax.Array, param: Any, spec: PartitionSpec) -> jax.Array:
        grad = grad.astype(jnp.result_type(param))
        if not explicit(mesh):  # the parameters' shardings are not visible
            grad = jnp.reshape(grad, jnp.shape(param))
            return lax.with_sharding_constraint(grad, NamedSharding(mesh, spec))
        own = _split.explicit_sharding(jax.typeof(param))
        sharding = own or NamedSharding(mesh, spec)
        if grad.shape != jnp.shape(param):
            grad = jnp.reshape(grad, jnp.shape(param), out_sharding=sharding)
        return jax.sharding.reshard(grad, sharding)

    embed, stages, head = grads
    return (
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), embed, params[0]),
        jax.tree.map(lambda g, p: like(g, p, stage_spec), stages, params[1]),
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), head, params[2]),
    )


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


def _unpack(params: Any) -> tuple:
    """``params`` as ``(embed, stages, head)``, checked: a sequence of 3."""
    if not (isinstance(params, tuple | list) and len(params) == 3):
        got = type(params).__name__
        if isinstance(params, tuple | list):
            got += f" of length {len(params)}"
        raise TypeError(
            "The pipelined step takes params = (embed_params, stage_params, "
            f"head_params), a sequence of 3 pytrees; got a {got}. Pass None "
            "(or ()) for a part with no parameters."
        )
    return tuple(params)


def _like_container(grads: tuple, params: Any) -> Any:
    """``grads`` in ``params``' own sequence type (a list, a NamedTuple):
    the gradients have the parameters' structure, for ``optax``."""
    if type(params) is tuple:
        return grads
    if isinstance(params, tuple):  # a NamedTuple
        return type(params)(*grads)
    return type(params)(grads)


def _refuse_fp8_metadata(params: tuple) -> None:
    """FP8 metadata is refused: autodiff through the loop sums every leaf's
    cotangents over the ticks, where the window maxes the metadata."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if _metadata.is_metadata(path, leaf):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is FP8 metadata (Flax's "
                f"{_metadata.OVERWRITE_WITH_GRADIENT} collection): the pipeline "
                "would sum its new values over the ticks like a gradient, where "
                "the window's amax history is the max over its micro-batches. "
                "Pipeline FP8-free stages, or accumulate FP8 models with "
                "jaxaccum.value_and_grad or shard_value_and_grad."
            )


def _report(raw: _Raw, prepared: Prepared, options: AccumOptions) -> Any:
    """The window's :class:`WindowStats` (``report_stats``), its
    :class:`FiniteReport` (``report_finite``: a micro-batch's loss and
    gradient finite), else ``()``."""
    if not _probed(options):
        return ()
    stats = pipeline_stats(raw, prepared, options)
    if options.report_finite:
        return FiniteReport(stats.microbatch_finite, stats.finite)
    return stats


def make_pipeline(
    functions: tuple,
    options: AccumOptions,
    mesh: Mesh | AbstractMesh | None,
    bubble_fill: float = 0.0,
) -> Callable[..., Any]:
    """The step of :func:`pipeline_value_and_grad` for ``options`` (whose
    ``pipeline`` is set); ``functions`` is ``(stage_fn, loss_fn, embed_fn)``;
    bubbles compute on ``bubble_fill`` (tests poison it with NaN)."""
    if mesh is not None and options.num_microbatches is not None:
        schedule_on(resolve_mesh(mesh, options), options)  # fail at construction

    def step(params: Any, batch: Any, key: Any = None, **kwargs: Any) -> Any:
        scale = pop_loss_scale(kwargs, options.loss_scale)
        if kwargs:
            raise TypeError(
                f"The pipelined step got unexpected keyword arguments "
                f"{sorted(kwargs)}: it takes step(params, batch, key=None) "
                "(and loss_scale= where built with loss_scale=True)."
            )
        given, params = params, _unpack(params)
        _refuse_fp8_metadata(params)
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
        raw = jax.jit(functools.partial(_differentiate, prepared, call, bubble_fill))(
            params, batch, key, None if scale is None else scale.loss_scale
        )
        value, aux, grads = _normalize(raw, prepared, call)
        grads = _like_container(_like_params(grads, params, prepared), given)
        result = ((value, aux), grads) if call.has_aux else (value, grads)
        report = _report(raw, prepared, call)
        if scale is not None:
            assert raw.finite is not None
            return result, loss_scale_report(raw.finite, scale, None, report)
        return (result, report) if _probed(call) else result

    return step


def pipeline_value_and_grad(
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    num_microbatches: int | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    embed_fn: Callable[..., Any] | None = None,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    repeats: int = 1,
    **options: Any,
) -> Callable[..., Any]:
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
    reduced once, after it. The schedule, the bubble, memory, FSDP and
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
    layout = PipelineLayout(stage_axis, data_axis, repeats)
    accum = AccumOptions.create(
        "pipeline_value_and_grad",
        num_microbatches,
        options,
        fixed={"pipeline": layout},
        refused=PIPELINE_REFUSED,
    )
    return make_pipeline((stage_fn, loss_fn, embed_fn), accum, mesh)


pipeline_value_and_grad.__signature__ = options_signature(  # type: ignore[attr-defined]
    pipeline_value_and_grad, exclude=PIPELINE_REFUSED
)
