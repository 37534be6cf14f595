"""What one accumulation window is, built from a front end's arguments and
validated once.

Every front end (``value_and_grad``, ``grad``, ``shard_value_and_grad``, the
Flax and Equinox helpers, ``plan``, ``testing``, the pipeline) turns its
keyword arguments into one :class:`WindowSpec` (the pipeline into its
subclass, ``jaxaccum._pipeline._spec.PipelineWindow``); the core loop reads
nothing else. How the window is sharded is its own small object,
:class:`jaxaccum._window._shard_spec.Sharding`, set by the sharded front ends alone.
Where a front end needs a variant it derives it with ``dataclasses.replace``.
"""

import dataclasses
import difflib
from collections.abc import Collection, Hashable, Mapping
from typing import Any, Self

import jax.numpy as jnp

from jaxaccum._checks import (
    argnums_tuple,
    check_accum_dtype,
    check_count,
    check_positive_int,
)
from jaxaccum._types import (
    AUX_REDUCTIONS,
    AXIS_LAYOUTS,
    CONV_LAYOUTS,
    REDUCTIONS,
    ArgNums,
    AuxReduction,
    AxisLayout,
    ConvLayout,
    PyTree,
    Reduction,
    Remat,
    declared_keywords,
)
from jaxaccum._window._shard_spec import SHARD_OPTIONS, Sharding

# What a window over a named axis does not take yet, and why.
AXIS_REFUSED: dict[str, str] = {
    "pad": "padded rows would meet the collectives over the window (a "
    "BatchNorm's statistics); pass a batch that N divides.",
    "masked": "every micro-batch is a member of the axis: a collective over "
    "it needs them all. Build one window per size instead.",
    "loss_scale": "not yet: the window over a named axis takes no float16 "
    "loss scale; use bfloat16, or jaxaccum.value_and_grad without axis_name.",
    "report_stats": "not yet: a coupled window's micro-batch gradients are not "
    "computed one by one, so there are no moments to report.",
    "report_finite": "not yet: check the value and gradients it returns with "
    "jnp.isfinite.",
}

# Aux reductions that keep one micro-batch's values: per device under shard_map.
PER_MICROBATCH_AUX: tuple[str, ...] = ("stack", "concat", "last")


@dataclasses.dataclass(frozen=True)
class WindowSpec:
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
      sharding: how the window is split over devices
        (:class:`jaxaccum._window._shard_spec.Sharding`; the default runs it whole).
      axis_name: the window as a named axis: ``fun``'s collectives over it
        meet across the micro-batches (``jaxaccum._axis``); None: no axis.
      axis_layout: which rows each member of the axis holds: ``"strided"``
        (micro-batch ``k``: rows ``k, k + N, ...``) or ``"contiguous"`` (the
        ``k``-th block of ``B / N`` rows, of each device's block per device).
      conv_layout: convolutions inside the window's loops: ``"auto"`` (the
        layout of the backend's fast kernel where that pays: CPU),
        ``"canonical"`` (that layout on any backend) or ``"traced"`` (as
        JAX traced them) (``jaxaccum._window._conv_layout``).
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
    sharding: Sharding = Sharding()
    axis_name: Hashable | None = None
    axis_layout: AxisLayout = "strided"
    conv_layout: ConvLayout = "auto"

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
        check_accum_dtype("accum_dtype", self.accum_dtype)
        if not isinstance(self.unroll, bool):
            check_positive_int("unroll", self.unroll, "Pass a bool or a count.")
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(
                f"conv_layout must be one of {CONV_LAYOUTS}, got {self.conv_layout!r}."
            )
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
        self._check_axis_name()

    def _check_axis_name(self) -> None:
        if self.axis_layout not in AXIS_LAYOUTS:
            raise ValueError(
                f"axis_layout must be one of {AXIS_LAYOUTS}, got {self.axis_layout!r}."
            )
        if self.axis_name is None:
            if self.axis_layout != "strided":
                raise ValueError(
                    f"axis_layout={self.axis_layout!r} without axis_name: the "
                    "layout says which rows each member of the window's axis "
                    "holds, and without an axis no collective sees the layout. "
                    "Pass axis_name too, or drop axis_layout."
                )
            return
        try:
            hash(self.axis_name)
        except TypeError:
            raise TypeError(
                f"axis_name must be hashable, as jax.vmap's is (a string such "
                f"as 'window'); got {self.axis_name!r} of type "
                f"{type(self.axis_name).__name__}."
            ) from None
        for name, why in AXIS_REFUSED.items():
            if getattr(self, name):
                raise ValueError(f"axis_name={self.axis_name!r} with {name}: {why}")

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The manual mesh axes the window's sums reduce over (none unsharded)."""
        return self.sharding.data_axes

    def resharded(self, **changes: Any) -> Self:
        """This window with its :class:`Sharding`'s ``changes``."""
        return dataclasses.replace(
            self, sharding=dataclasses.replace(self.sharding, **changes)
        )

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
    def full_batch(self) -> Self:
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
        keywords: type,
        *,
        fixed: Mapping[str, Any] | None = None,
        refused: Mapping[str, str] | None = None,
    ) -> Self:
        """The options of a call of the front end ``where``: the one way every
        front end builds them.

        Args:
          where: the front end's name, for messages (``"value_and_grad"``).
          num_microbatches: the call's ``N`` (or None, with
            ``microbatch_size`` among ``options``).
          options: the caller's keyword options, names of fields.
          keywords: the front end's keyword bag (a ``TypedDict`` of
            :mod:`jaxaccum._types`, what its signature ``Unpack`` s): the
            one source of the options it takes.
          fixed: fields the front end sets itself (its argument roles, a
            sharded front end's ``data_axes``).
          refused: why it does not take some fields, and what to use.

        Raises:
          TypeError: naming the keyword, for one ``keywords`` does not
            declare (with why where ``refused`` or ``fixed`` says, else
            listing the front end's options).
        """
        fixed = dict(fixed or {})
        cls.check_keywords(where, options, keywords, fixed=fixed, refused=refused)
        given = {**options, **fixed}
        sharded = {k: given.pop(k) for k in Sharding.field_names() & set(given)}
        if sharded:
            given["sharding"] = Sharding(**sharded)
        return cls(num_microbatches, **given)

    @classmethod
    def check_keywords(
        cls,
        where: str,
        options: Collection[str],
        keywords: type,
        *,
        fixed: Collection[str] = (),
        refused: Mapping[str, str] | None = None,
    ) -> None:
        """Raises :meth:`create`'s errors for the keyword names ``options``:
        those ``keywords`` declares are taken, no other."""
        declared = declared_keywords(keywords)
        refused = refused or {}
        for name in options:
            if name in declared:
                continue
            if name in refused:
                raise TypeError(f"{where} does not take {name}: {refused[name]}")
            if name in fixed:
                raise TypeError(
                    f"{where} sets {name} itself: pass the arguments in the "
                    "layout its docstring gives, or use jaxaccum.value_and_grad "
                    "for another layout."
                )
            close = difflib.get_close_matches(name, sorted(declared), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{where} got an unknown keyword argument {name!r}{hint}; its "
                f"options are: {', '.join(sorted(declared))}."
            )


# Why the testing and planning front ends refuse loss_scale.
NO_LOSS_SCALE = (
    "a loss scale changes neither memory nor the gradient it unscales: compare "
    "or plan without it."
)

# What the checks and plans that compare windows refuse (they build the
# windows they compare, unscaled and unsharded).
COMPARE_REFUSED: dict[str, str] = {**SHARD_OPTIONS, "loss_scale": NO_LOSS_SCALE}
