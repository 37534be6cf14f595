"""The options of an accumulated function, built and validated once.

Every front end (``value_and_grad``, ``grad``, ``shard_value_and_grad``, the
Flax helpers, ``plan``, ``testing``) turns its keyword arguments into one
:class:`AccumOptions`; the core reads nothing else. A new option is added here,
and where a front end needs a variant it derives it with
``dataclasses.replace``.
"""

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._checks import argnums_tuple, check_count, check_positive_int
from jaxaccum._types import (
    AUX_REDUCTIONS,
    REDUCTIONS,
    SCHEDULES,
    SHARD_MODES,
    ArgNums,
    AuxReduction,
    PyTree,
    Reduction,
    Remat,
    ScheduleName,
    ShardMode,
)

# Aux reductions that keep one micro-batch's values: per device under shard_map.
PER_MICROBATCH_AUX: tuple[str, ...] = ("stack", "concat", "last")


# The aux reductions of a pipeline: each micro-batch's aux is computed on the
# last stage's device, per data shard, and summed there.
PIPELINE_AUX_REDUCTIONS: tuple[str, ...] = ("mean", "sum")


# The pipeline's schedules (docs/guides/pipeline.md): the names of
# jaxaccum._pipeline._schedules.SCHEDULES, where each becomes its class.
PIPELINE_SCHEDULES: tuple[str, ...] = SCHEDULES


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Where a pipelined window's stages and batch lie: the pipeline's part of
    :class:`AccumOptions`, set by :func:`jaxaccum.pipeline_value_and_grad`.

    Attributes:
      stage_axis: the mesh axis the stages are placed on.
      data_axis: the mesh axis the batch is sharded over, or None.
      repeats: ``R``, stages per device (circular schedule when > 1).
      schedule: ``"gpipe"`` or ``"1f1b"``.
    """

    stage_axis: str = "stage"
    data_axis: str | None = None
    repeats: int = 1
    schedule: ScheduleName = "gpipe"

    def __post_init__(self) -> None:
        check_positive_int("repeats", self.repeats)
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"schedule must be one of {PIPELINE_SCHEDULES}, got {self.schedule!r}."
            )
        for name in ("stage_axis", "data_axis"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (name == "data_axis" and value is None)):
                raise TypeError(f"{name} must be a mesh axis name, got {value!r}.")
        if self.data_axis == self.stage_axis:
            raise ValueError(
                f"data_axis and stage_axis are both {self.stage_axis!r}: the "
                "batch is sharded over one mesh axis, the stages placed on "
                "another."
            )

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the window runs manual over."""
        return (self.stage_axis,) + ((self.data_axis,) if self.data_axis else ())


@dataclasses.dataclass(frozen=True)
class AccumOptions:
    """How a function is accumulated; see :func:`jaxaccum.value_and_grad`.

    Attributes:
      num_microbatches: ``N``; exactly one of it and ``microbatch_size``.
      microbatch_size: examples per micro-batch.
      argnums: argument(s) differentiated.
      batch_argnums: argument(s) split into micro-batches.
      key_argnums: PRNG key argument(s), split per micro-batch.
      state_argnums: state argument(s) carried through the micro-batches.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: what ``fun``'s loss is over its batch.
      aux_reduction: how aux leaves combine over micro-batches.
      accum_dtype: dtype float sums accumulate in (at least).
      pad: pad a batch that ``N`` does not divide, masking the padded rows.
      unroll: passed to ``jax.lax.scan``.
      remat: ``True`` or a checkpoint policy: ``jax.checkpoint`` the loss.
      report_finite: also return a :class:`jaxaccum.FiniteReport`.
      report_stats: also return a :class:`jaxaccum.WindowStats`.
      masked: ``N`` is a maximum; the call's ``active_microbatches`` (traced)
        says how many micro-batches are computed, the rest are skipped.
      loss_scale: the call's ``loss_scale`` (a :class:`jaxaccum.DynamicLossScale`,
        traced) multiplies every micro-batch's loss; the report is a
        :class:`jaxaccum.LossScaleReport`.
      data_axes: manual mesh axes the batch is split over (``shard_map``):
        each device accumulates its rows, reduced once after the loop.
      param_gather: when parameters sharded over ``data_axes`` are gathered.
      grad_reduce: when gradients are reduced over ``data_axes``.
      gather_dtype: dtype parameters are cast to before they are gathered.
      param_specs: per differentiated leaf (flattened), its ``PartitionSpec``
        outside the ``shard_map`` (``P()`` where unknown); set per call.
      pipeline: a pipelined window's :class:`PipelineLayout` (set by
        ``pipeline_value_and_grad``), else None.
    """

    num_microbatches: int | None = None
    microbatch_size: int | None = None
    argnums: ArgNums = 0
    batch_argnums: ArgNums = 1
    key_argnums: ArgNums = ()
    state_argnums: ArgNums = ()
    has_aux: bool = False
    reduction: Reduction = "mean"
    aux_reduction: AuxReduction | PyTree = "mean"
    accum_dtype: Any = jnp.float32
    pad: bool = False
    unroll: int | bool = 1
    remat: Remat = False
    report_finite: bool = False
    report_stats: bool = False
    masked: bool = False
    loss_scale: bool = False
    data_axes: tuple[str, ...] = ()
    param_gather: ShardMode = "auto"
    grad_reduce: ShardMode = "auto"
    gather_dtype: Any = None
    param_specs: tuple[Any, ...] = ()
    pipeline: PipelineLayout | None = None

    def __post_init__(self) -> None:
        if (self.num_microbatches is None) == (self.microbatch_size is None):
            raise ValueError(
                "Pass exactly one of num_microbatches (how many micro-batches) "
                "and microbatch_size (examples per micro-batch); got "
                f"num_microbatches={self.num_microbatches!r}, "
                f"microbatch_size={self.microbatch_size!r}."
            )
        if self.num_microbatches is not None:
            check_count("num_microbatches", self.num_microbatches)
        else:
            check_count("microbatch_size", self.microbatch_size)
        if not isinstance(self.unroll, bool):
            check_positive_int("unroll", self.unroll, "Pass a bool or a count.")
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}."
            )
        if isinstance(self.aux_reduction, str) and (
            self.aux_reduction not in AUX_REDUCTIONS
        ):
            raise ValueError(
                f"Unknown aux_reduction {self.aux_reduction!r}; use one of "
                f"{AUX_REDUCTIONS}, or a pytree prefix of the aux output mapping "
                "leaves to them."
            )
        if self.pad and self.reduction == "mean":
            raise ValueError(
                "pad=True needs reduction='weighted' (or 'sum'): padded rows make "
                "the micro-batches' real sizes unequal, so the mean of their means "
                "is not the batch mean. Return (loss_sum, weight) from fun, with "
                "example_mask applied to both, and use reduction='weighted'."
            )
        for name in ("param_gather", "grad_reduce"):
            if getattr(self, name) not in SHARD_MODES:
                raise ValueError(
                    f"{name} must be one of {SHARD_MODES}, got {getattr(self, name)!r}."
                )
        if self.gather_dtype is not None and not jnp.issubdtype(
            self.gather_dtype, jnp.floating
        ):
            raise ValueError(
                f"gather_dtype must be a floating dtype such as jnp.bfloat16 (or "
                f"None), got {self.gather_dtype!r}."
            )
        if not (
            self.remat is None or isinstance(self.remat, bool) or callable(self.remat)
        ):
            raise TypeError(
                "remat must be True, False (or None) or a jax.checkpoint policy (e.g. "
                "jax.checkpoint_policies.dots_saveable), got "
                f"{self.remat!r} of type {type(self.remat).__name__}."
            )
        if not isinstance(self.loss_scale, bool):
            raise TypeError(
                "loss_scale must be True or False when the function is built, got "
                f"a {type(self.loss_scale).__name__}: the scale changes every "
                "window, so build with loss_scale=True and pass the state per "
                "call, accumulated(..., loss_scale=jaxaccum.dynamic_loss_scale())."
            )
        if self.report_finite and self.report_stats:
            raise ValueError(
                "report_stats already holds the finite flags of report_finite "
                "(WindowStats.microbatch_finite and .finite); pass report_stats "
                "alone."
            )
        self._check_roles()
        if self.pipeline is not None:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        for name in ("param_gather", "grad_reduce"):
            if getattr(self, name) == "microbatch":
                raise ValueError(
                    f"{name}='microbatch' does not apply to a pipeline: a "
                    "stage's device runs every micro-batch's ticks of its "
                    "stages, so FSDP parameters are gathered once per window, "
                    "before the loop, and their gradients reduce-scattered "
                    "once, after it. Use 'window' (or 'auto')."
                )
        if not set(jax.tree.leaves(self.aux_reduction)) <= set(PIPELINE_AUX_REDUCTIONS):
            raise ValueError(
                f"aux_reduction must be one of {PIPELINE_AUX_REDUCTIONS} (or a "
                "pytree prefix of the aux output mapping leaves to them) in a "
                f"pipeline, got {self.aux_reduction!r}: each micro-batch's aux "
                "is computed on the last stage's device, per data shard."
            )

    @property
    def layout(self) -> PipelineLayout:
        """The pipeline's layout; a ValueError if this window is not one."""
        if self.pipeline is None:
            raise ValueError("these options are not a pipelined window's")
        return self.pipeline

    def _check_roles(self) -> None:
        roles = self.roles
        if not roles["argnums"]:
            raise ValueError(
                "argnums must name at least one argument to differentiate."
            )
        if not roles["batch_argnums"]:
            raise ValueError("batch_argnums must name at least one batch argument.")
        all_nums = self.all_nums
        for index, num in enumerate(all_nums):
            if num in all_nums[:index]:
                named = [name for name, nums in roles.items() if num in nums]
                raise ValueError(
                    f"Argument {num} is in {' and '.join(named)}; an argument is "
                    "differentiated, split into micro-batches, a PRNG key to split, "
                    "or carried state: only one of these."
                )

    @property
    def roles(self) -> dict[str, tuple[int, ...]]:
        """Each argument role's name and its argument numbers, as tuples."""
        return {
            name: argnums_tuple(name, getattr(self, name))
            for name in ("argnums", "batch_argnums", "key_argnums", "state_argnums")
        }

    @property
    def diff_nums(self) -> tuple[int, ...]:
        return argnums_tuple("argnums", self.argnums)

    @property
    def batch_nums(self) -> tuple[int, ...]:
        return argnums_tuple("batch_argnums", self.batch_argnums)

    @property
    def key_nums(self) -> tuple[int, ...]:
        return argnums_tuple("key_argnums", self.key_argnums)

    @property
    def state_nums(self) -> tuple[int, ...]:
        return argnums_tuple("state_argnums", self.state_argnums)

    @property
    def all_nums(self) -> tuple[int, ...]:
        """Every argument number with a role, in role order."""
        return sum(self.roles.values(), ())

    @property
    def reports(self) -> bool:
        """Whether the accumulated function returns ``(out, report)``."""
        return self.report_finite or self.report_stats or self.loss_scale

    @property
    def full_batch(self) -> "AccumOptions":
        """These options with one micro-batch: exactly ``jax.value_and_grad``."""
        return dataclasses.replace(
            self, num_microbatches=1, microbatch_size=None, masked=False
        )

    @classmethod
    def create(
        cls,
        where: str,
        num_microbatches: int | None,
        options: Mapping[str, Any],
        *,
        fixed: Mapping[str, Any] | None = None,
        refused: Mapping[str, str] | None = None,
    ) -> "AccumOptions":
        """The options of a call of the front end ``where``: the one way every
        front end builds them.

        Args:
          where: the front end's name, for messages (``"value_and_grad"``).
          num_microbatches: the call's ``N`` (or None, with
            ``microbatch_size`` among ``options``).
          options: the caller's keyword options, names of fields.
          fixed: fields the front end sets itself (its argument roles).
          refused: fields it does not take, each with why and what to use.

        Raises:
          TypeError: naming the keyword, for one that is not a field (listing
            the front end's options), one in ``fixed`` or in ``refused``, or
            a field set per call (``data_axes``, ``param_specs``).
        """
        fixed = dict(fixed or {})
        cls.check_keywords(where, options, fixed=fixed, refused=refused)
        return cls(num_microbatches, **options, **fixed)

    @classmethod
    def check_keywords(
        cls,
        where: str,
        options: Collection[str],
        *,
        fixed: Collection[str] = (),
        refused: Mapping[str, str] | None = None,
    ) -> None:
        """Raises :meth:`create`'s errors for the keyword names ``options``."""
        refused = refused or {}
        for name in options:
            if name in refused:
                raise TypeError(f"{where} does not take {name}: {refused[name]}")
            if name in fixed:
                raise TypeError(
                    f"{where} sets {name} itself: pass the arguments in the "
                    "layout its docstring gives, or use jaxaccum.value_and_grad "
                    "for another layout."
                )
            if name not in cls.option_names():
                accepted = sorted(cls.option_names() - set(fixed) - set(refused))
                raise TypeError(
                    f"{where} got an unknown keyword argument {name!r}; its "
                    f"options are: {', '.join(accepted)}."
                )

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The fields a caller may set (every field but ``num_microbatches``,
        which front ends take positionally, those set per call, and the
        pipeline's layout, which its front end sets)."""
        per_call = {"num_microbatches", "data_axes", "param_specs", "pipeline"}
        return frozenset(field.name for field in dataclasses.fields(cls)) - per_call


# Options of shard_value_and_grad alone: how parameters sharded over the data
# axes are gathered and gradients reduced over them.
SHARD_OPTIONS: dict[str, str] = {
    name: "it is an option of jaxaccum.shard_value_and_grad (how parameters "
    "sharded over the data axes are gathered and gradients reduced)."
    for name in ("param_gather", "grad_reduce", "gather_dtype")
}


_PIPELINE_ROLES = (
    "the pipeline's step has one layout, step(params, batch, key=None): "
    "params = (embed_params, stage_params, head_params) differentiated, the "
    "batch split into micro-batches, the key split per micro-batch."
)
_PIPELINE_FSDP = (
    "a pipeline casts its parameters to the accumulation dtype before the "
    "loop (their gradients accumulate over the ticks there) and gathers FSDP "
    "parameters once per window in it; accum_dtype=None gathers them in "
    "their own dtype."
)
# What the core takes that a pipeline cannot, each with why.
PIPELINE_REFUSED: dict[str, str] = {
    "argnums": _PIPELINE_ROLES,
    "batch_argnums": _PIPELINE_ROLES,
    "key_argnums": _PIPELINE_ROLES,
    "state_argnums": (
        "carried state (BatchNorm) would have to pass from stage to stage "
        "between micro-batches, which the schedule runs at once on different "
        "devices; keep running statistics out of pipelined stages."
    ),
    "pad": (
        "every micro-batch flows through every stage with one shape: pass a "
        "batch that M (times the data shards) divides."
    ),
    "masked": (
        "the schedule's ticks are fixed when it is compiled: build a step "
        "per window length."
    ),
    "gather_dtype": _PIPELINE_FSDP,
}


# Why the testing and planning front ends refuse loss_scale.
NO_LOSS_SCALE = (
    "a loss scale changes neither memory nor the gradient it unscales: compare "
    "or plan without it."
)

# What the checks and plans that compare windows refuse (they build the
# windows they compare, unscaled and unsharded).
COMPARE_REFUSED: dict[str, str] = {**SHARD_OPTIONS, "loss_scale": NO_LOSS_SCALE}
