"""The types of jaxaccum's public surface, named once.

The tree aliases say what an ``Any`` holds (optax's ``base.py`` does the same:
``Params = Any``). The keyword bags are the front ends' options as PEP 692
``TypedDict`` s, built from small groups, one per feature, so that a front
end's ``**options: Unpack[...]`` lists exactly the options it takes and a type
checker flags a misspelt or ill-typed one. The run-time checks stay in
:class:`jaxaccum._window._spec.WindowSpec` (users without a type checker get the
same option named in the error).
"""

import functools
import typing
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

from jax.sharding import AbstractMesh, Mesh
from jax.typing import DTypeLike
from typing_extensions import TypedDict

# A pytree of arrays (or of ``jax.ShapeDtypeStruct`` values, when planning).
PyTree = Any
# The differentiated argument(s) of a loss: a pytree of float arrays.
Params = PyTree
# A batch argument: a pytree whose leaves share a leading axis of examples.
Batch = PyTree
# Gradients: a pytree shaped like the differentiated ``Params``.
Grads = PyTree
# A loss (or stage, embedding) function of pytrees, returning a pytree.
Fun = Callable[..., PyTree]

Reduction = Literal["mean", "sum", "weighted"]
AuxReduction = Literal["mean", "sum", "stack", "concat", "last"]
# When parameters sharded over the data axes are gathered, and when gradients
# are reduced over them (shard_value_and_grad): once per window or per
# micro-batch; "auto" picks per leaf (see shard_value_and_grad).
ShardMode = Literal["auto", "window", "microbatch"]
# Which rows each member of the window as a named axis holds: "strided"
# (micro-batch k: rows k, k + N, ...) or "contiguous" (the k-th block of rows,
# as data parallelism lays out devices).
AxisLayout = Literal["strided", "contiguous"]
# Convolutions inside the window's loops: "auto" puts them in the layout of
# the backend's fast kernel where that was measured to pay (CPU),
# "canonical" everywhere, "traced" leaves them as JAX traced them.
ConvLayout = Literal["auto", "canonical", "traced"]
ScheduleName = Literal["gpipe", "1f1b", "zero-bubble", "v-zb", "v-half"]
"""A pipeline schedule's name: what :func:`jaxaccum.pipeline_value_and_grad`
and :func:`jaxaccum.plan_pipeline` take as ``schedule=`` and what
:class:`jaxaccum.PipelinePlan` chose (pass ``plan.schedule`` on). ``"1f1b"``
with ``repeats > 1`` is interleaved 1F1B; ``"v-zb"`` is the V-shaped
zero-bubble and ``"v-half"`` the V at less memory (``repeats=2``). Guide:
[Pipeline parallelism](../guides/pipeline.md)."""
ArgNums = int | Sequence[int]
# ``True`` (or ``False``/``None``) or a ``jax.checkpoint`` policy.
Remat = bool | Callable[..., bool] | None

REDUCTIONS: tuple[str, ...] = typing.get_args(Reduction)
AUX_REDUCTIONS: tuple[str, ...] = typing.get_args(AuxReduction)
SHARD_MODES: tuple[str, ...] = typing.get_args(ShardMode)
SCHEDULES: tuple[str, ...] = typing.get_args(ScheduleName)
StageOrder = Literal["model", "device"]
"""How :func:`jaxaccum.pipeline_value_and_grad`'s ``S R`` stacked stages
are ordered (its ``stage_order=``): ``"model"``, row ``i`` is model stage
``i``; ``"device"``, row ``d R + r`` is the ``r``-th stage device ``d`` runs
(:func:`jaxaccum.pipeline_stage_order`), so no parameter is relaid out.
Guide: [Pipeline parallelism](../guides/pipeline.md#device-order)."""
STAGE_ORDERS: tuple[str, ...] = typing.get_args(StageOrder)
AXIS_LAYOUTS: tuple[str, ...] = typing.get_args(AxisLayout)
CONV_LAYOUTS: tuple[str, ...] = typing.get_args(ConvLayout)


class _Window(TypedDict, total=False):
    """The options every front end takes."""

    reduction: Reduction
    # One of AuxReduction, or a pytree prefix of the aux output mapping
    # leaves to them.
    aux_reduction: AuxReduction | PyTree
    accum_dtype: DTypeLike | None
    unroll: int | bool
    remat: Remat
    report_stats: bool
    conv_layout: ConvLayout


class _Size(TypedDict, total=False):
    microbatch_size: int | None


class _HasAux(TypedDict, total=False):
    has_aux: bool


class _Pad(TypedDict, total=False):
    pad: bool


class _Finite(TypedDict, total=False):
    report_finite: bool


class _Masked(TypedDict, total=False):
    masked: bool


class _LossScale(TypedDict, total=False):
    loss_scale: bool


class _Argnums(TypedDict, total=False):
    argnums: ArgNums


class _BatchRoles(TypedDict, total=False):
    batch_argnums: ArgNums
    key_argnums: ArgNums


class _State(TypedDict, total=False):
    state_argnums: ArgNums


class _AxisName(TypedDict, total=False):
    # The window as a named axis: a hashable name, as jax.vmap's axis_name.
    axis_name: Hashable | None
    # Which rows each of its members (micro-batches) holds.
    axis_layout: AxisLayout


class _ShardModes(TypedDict, total=False):
    param_gather: ShardMode
    grad_reduce: ShardMode


# A pipeline gathers FSDP parameters once per window and reduces their
# gradients once: "microbatch" does not apply (see pipeline_value_and_grad).
PipelineShardMode = Literal["auto", "window"]


class _PipelineShardModes(TypedDict, total=False):
    param_gather: PipelineShardMode
    grad_reduce: PipelineShardMode


class _GatherDtype(TypedDict, total=False):
    gather_dtype: DTypeLike | None


class _Compared(_Window, _Size, _HasAux, _Pad, _Finite, _Masked):
    """What the checks that compare windows take: unscaled, unsharded."""


class FlaxKwargs(_Window, _Size, _Pad, _Finite, _Masked, _LossScale, _AxisName):
    """The options of the Flax front ends, which set the argument roles and
    take ``has_aux`` themselves."""


class FilterKwargs(FlaxKwargs, _HasAux, _BatchRoles, _State):
    """The options of the Equinox front ends, which differentiate the model."""


class AccumKwargs(FilterKwargs, _Argnums):
    """The options of :func:`jaxaccum.value_and_grad` and :func:`jaxaccum.grad`."""


class FlaxCompareKwargs(_Compared):
    """The options of the Flax checks (their argument roles are set)."""


class FilterCompareKwargs(_Compared, _BatchRoles, _State):
    """The options of the Equinox checks."""


class CompareKwargs(FilterCompareKwargs, _Argnums, _AxisName):
    """The options of :func:`jaxaccum.testing.assert_grads_match_full_batch`
    and :func:`jaxaccum.testing.diagnose`."""


class PlanKwargs(
    _Window, _HasAux, _Pad, _Finite, _Argnums, _BatchRoles, _State, _AxisName
):
    """The options of :func:`jaxaccum.plan`: it chooses ``N`` and builds
    unmasked, unscaled windows."""


class ShardKwargs(
    _Window,
    _Size,
    _HasAux,
    _Pad,
    _Argnums,
    _BatchRoles,
    _LossScale,
    _ShardModes,
    _GatherDtype,
    _AxisName,
):
    """The options of :func:`jaxaccum.shard_value_and_grad`."""


class ModePlanKwargs(
    _Window, _HasAux, _Pad, _Argnums, _BatchRoles, _GatherDtype, _AxisName
):
    """The options of :func:`jaxaccum.plan_modes`, which sets the modes (and
    takes ``num_microbatches``, not ``microbatch_size``)."""


class CachedKwargs(_Size, _HasAux, _Argnums, _BatchRoles, total=False):
    """The options of :func:`jaxaccum.cached_value_and_grad`: the window's
    split, roles, accumulation dtype and unroll (no reduction, state, pad,
    mask, loss scale or remat: the loss sees the whole batch, once), and
    the mesh it runs per device on."""

    accum_dtype: DTypeLike | None
    unroll: int | bool
    conv_layout: ConvLayout
    mesh: Mesh | AbstractMesh | None
    data_axis: str | Sequence[str] | None


class PipelinePlanKwargs(_Window, _HasAux, _Finite, _PipelineShardModes):
    """The options of :func:`jaxaccum.plan_pipeline`: it chooses ``M`` and
    plans unscaled windows."""


class PipelineKwargs(PipelinePlanKwargs, _Size, _LossScale):
    """The options of :func:`jaxaccum.pipeline_value_and_grad`."""


@functools.cache
def declared_keywords(keywords: type) -> frozenset[str]:
    """The keys a keyword bag (one of the ``TypedDict`` s above) declares:
    the options its front end takes, at run time as in its signature."""
    return frozenset(typing.get_type_hints(keywords))
