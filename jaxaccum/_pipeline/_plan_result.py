"""What :func:`jaxaccum.plan_pipeline` returns: the plan, one row per
compiled configuration, the efficiency it is chosen by, and its table."""

import dataclasses

from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._plan._plan import format_bytes
from jaxaccum._types import Remat, ScheduleName


@dataclasses.dataclass(frozen=True)
class PipelinePlanRow:
    """The compiled memory of the pipelined step at one ``(M, schedule,
    remat)``.

    Attributes:
      num_microbatches: ``M``.
      schedule: ``"gpipe"``, ``"1f1b"`` (interleaved with ``repeats > 1``)
        or ``"zero-bubble"``.
      remat: the ``remat`` compiled (False, True or a checkpoint policy).
      batch_size: rows of the window's batch, ``M`` micro-batches.
      bubble: ``(S - 1) / (M R + S - 1)``, the share of ticks idle.
      efficiency: the share of the window's stage work that is useful
        (:func:`efficiency`).
      temp_bytes: bytes of temporaries XLA allocates while the step runs.
      total_bytes: the footprint per device, arguments + outputs +
        temporaries - aliased bytes (as :class:`jaxaccum.MemoryPlanRow`).
      compile_seconds: wall time to lower and compile the step.
      fits: whether ``total_bytes`` is within the budget.
    """

    num_microbatches: int
    schedule: ScheduleName
    remat: Remat
    batch_size: int
    bubble: float
    efficiency: float
    temp_bytes: int
    total_bytes: int
    compile_seconds: float
    fits: bool


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The result of :func:`plan_pipeline`; ``print`` it for the table.

    Attributes:
      num_microbatches: the chosen ``M``; pass it (and ``schedule`` and
        ``remat``) to :func:`jaxaccum.pipeline_value_and_grad`.
      schedule: the chosen schedule, ``"gpipe"``, ``"1f1b"`` (interleaved
        with ``repeats > 1``) or ``"zero-bubble"``.
      remat: the chosen ``remat``.
      microbatch_rows: rows of one micro-batch over all data shards.
      batch_size: the window's batch at the chosen ``M``.
      bubble: the chosen configuration's bubble fraction.
      efficiency: its share of useful stage work.
      recompute: the share of a stage's forward and backward FLOPs that its
        forward is (what ``remat`` adds), from ``cost_analysis()`` of one
        stage; 1/3 where the backend counts no FLOPs (``recompute_measured``).
      recompute_measured: whether ``recompute`` was counted, not assumed.
      memory_budget: the budget in bytes.
      footprint_bytes: the compiled footprint per device at the choice.
      rows: every compiled configuration, by schedule, ``remat``, ``M``.
    """

    num_microbatches: int
    schedule: ScheduleName
    remat: Remat
    microbatch_rows: int
    batch_size: int
    bubble: float
    efficiency: float
    recompute: float
    recompute_measured: bool
    memory_budget: int
    footprint_bytes: int
    rows: tuple[PipelinePlanRow, ...]

    def __str__(self) -> str:
        header = (
            f"Pipeline plan (grads): micro-batch {self.microbatch_rows} rows, "
            f"budget {format_bytes(self.memory_budget)} -> num_microbatches="
            f"{self.num_microbatches}, schedule={self.schedule!r}, "
            f"remat={_name(self.remat)} (batch "
            f"{self.batch_size}, bubble {self.bubble:.3f}, efficiency "
            f"{self.efficiency:.3f}), footprint {format_bytes(self.footprint_bytes)}"
        )
        how = "counted" if self.recompute_measured else "assumed"
        header += f"; remat recomputes {self.recompute:.2f} of a tick ({how})"
        return header + "\n" + _table(self.rows, self)


def efficiency(schedule: Schedule, remat: Remat, recompute: float) -> float:
    """The share of a window's modeled time that is useful work: a
    device's ``3 M R`` over the schedule's :meth:`Schedule.modeled_window`,
    and ``remat`` adds a forward to each backward (``recompute`` of the
    two; an upper bound for a checkpoint policy). GPipe computes its bubbles
    on masked inputs, ``3 (M R + S - 1)``; 1F1B skips its bubbles' slots,
    ``3 (M + S - 1)`` too (the schedules differ in memory); zero-bubble's
    window is shorter (its W slots deferred into idle ones)."""
    useful = schedule.useful_work / schedule.modeled_window()
    return useful / (1 + (recompute if remat else 0.0))


def _name(remat: Remat) -> str:
    """``remat``'s label: False, None (both no remat), True, or the policy's
    name."""
    if remat is None or isinstance(remat, bool):
        return repr(remat)
    return getattr(remat, "__name__", "policy")


def nothing_fits(ordered: tuple[PipelinePlanRow, ...], budget: int) -> ValueError:
    """The error when no compiled configuration fits: the smallest, the table."""
    smallest = min(ordered, key=lambda row: row.total_bytes)
    return ValueError(
        f"No window fits memory_budget={format_bytes(budget)} ({budget} "
        f"bytes): the smallest footprint compiled is "
        f"{format_bytes(smallest.total_bytes)} at num_microbatches="
        f"{smallest.num_microbatches}, schedule={smallest.schedule!r}, "
        f"remat={_name(smallest.remat)}. Raise "
        "the budget, or use a smaller micro-batch or model.\n" + _table(ordered, None)
    )


def _table(rows: tuple[PipelinePlanRow, ...], chosen: PipelinePlan | None) -> str:
    header = (
        "M",
        "schedule",
        "remat",
        "batch",
        "bubble",
        "efficiency",
        "temp",
        "total",
        "fits",
    )
    lines = [header] + [
        (
            str(row.num_microbatches),
            row.schedule,
            _name(row.remat),
            str(row.batch_size),
            f"{row.bubble:.3f}",
            f"{row.efficiency:.3f}",
            format_bytes(row.temp_bytes),
            format_bytes(row.total_bytes),
            ("yes" if row.fits else "no")
            + (
                "  <- chosen"
                if chosen is not None
                and (row.num_microbatches, row.schedule, row.remat)
                == (chosen.num_microbatches, chosen.schedule, chosen.remat)
                else ""
            ),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(8)]
    return "\n".join(
        "  ".join(
            [*(c.rjust(w) for c, w in zip(line[:8], widths, strict=True)), line[8]]
        )
        for line in lines
    )
