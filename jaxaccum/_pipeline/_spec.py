"""What a pipelined window is: the core window (``WindowSpec``) plus where
its stages and batch lie (:class:`PipelineLayout`), and what a pipeline
refuses of the core's options. Built by the pipeline's front ends alone."""

import dataclasses

import jax

from jaxaccum._checks import check_positive_int
from jaxaccum._types import SCHEDULES, STAGE_ORDERS, ScheduleName, StageOrder
from jaxaccum._window._spec import WindowSpec

# The aux reductions of a pipeline: each micro-batch's aux is computed on the
# last stage's device, per data shard, and summed there.
PIPELINE_AUX_REDUCTIONS: tuple[str, ...] = ("mean", "sum")


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Where a pipelined window's stages and batch lie, set by
    :func:`jaxaccum.pipeline_value_and_grad`.

    Attributes:
      stage_axis: the mesh axis the stages are placed on.
      data_axis: the mesh axis the batch is sharded over, or None.
      repeats: ``R``, stages per device (circular schedule when > 1).
      schedule: the name of a schedule in ``_schedules.SCHEDULES``.
      stage_order: how the ``S R`` stacked stages are ordered: ``"model"``
        (row ``i`` is model stage ``i``) or ``"device"`` (row ``d R + r`` is
        the ``r``-th stage device ``d`` runs: :func:`jaxaccum.pipeline_stage_order`).
    """

    stage_axis: str = "stage"
    data_axis: str | None = None
    repeats: int = 1
    schedule: ScheduleName = "gpipe"
    stage_order: StageOrder = "model"

    def __post_init__(self) -> None:
        check_positive_int("repeats", self.repeats)
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {SCHEDULES}, got {self.schedule!r}."
            )
        if self.stage_order not in STAGE_ORDERS:
            raise ValueError(
                f"stage_order must be one of {STAGE_ORDERS}, got "
                f'{self.stage_order!r}: "model" stacks the stages in model '
                'order, "device" as the devices hold them '
                "(jaxaccum.pipeline_stage_order)."
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
class PipelineWindow(WindowSpec):
    """A pipelined window: :class:`WindowSpec` and its ``layout``; refuses
    what a pipeline cannot run (per-micro-batch FSDP modes, an aux
    reduction other than ``PIPELINE_AUX_REDUCTIONS``)."""

    layout: PipelineLayout = PipelineLayout()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("param_gather", "grad_reduce"):
            if getattr(self.sharding, name) == "microbatch":
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
    "axis_name": (
        "the schedule runs the micro-batches at different stages at once, so "
        "a collective across them (BatchNorm's statistics over the window) "
        "cannot meet; keep batch statistics out of pipelined stages."
    ),
    "masked": (
        "the schedule's ticks are fixed when it is compiled: build a step "
        "per window length."
    ),
    "gather_dtype": _PIPELINE_FSDP,
}
