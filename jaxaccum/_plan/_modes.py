"""The sharded modes' planner: each ``param_gather`` x ``grad_reduce``
combination compiled, its memory and its communication per window."""

import dataclasses

import jax
from jax.sharding import AbstractMesh, Mesh
from typing_extensions import Unpack

from jaxaccum._plan._hlo import window_bytes
from jaxaccum._plan._memory_budget import parse_memory_budget
from jaxaccum._plan._plan import format_bytes, total_bytes
from jaxaccum._shard._shard import DataAxis, shard_value_and_grad
from jaxaccum._types import Fun, ModePlanKwargs, PyTree, ShardMode
from jaxaccum._window._spec import NO_LOSS_SCALE, WindowSpec


@dataclasses.dataclass(frozen=True)
class ModePlanRow:
    """One ``param_gather`` x ``grad_reduce`` combination, compiled.

    Attributes:
      param_gather: when FSDP parameters are gathered.
      grad_reduce: when gradients are reduced.
      total_bytes: the per-device footprint (arguments + outputs +
        temporaries - aliased), from ``compiled.memory_analysis()``.
      temp_bytes: the per-device temporaries (gathered parameters, gradient
        accumulators, activations).
      window_bytes: bytes the step's collectives move per window and device
        (:func:`jaxaccum.testing.window_bytes`).
      fits: whether ``total_bytes`` is within the budget.
    """

    param_gather: str
    grad_reduce: str
    total_bytes: int
    temp_bytes: int
    window_bytes: int
    fits: bool


@dataclasses.dataclass(frozen=True)
class ModePlan:
    """The result of :func:`plan_modes`; ``print`` it for the table.

    Attributes:
      param_gather: the chosen ``param_gather`` (pass it on with
        ``grad_reduce`` to :func:`jaxaccum.shard_value_and_grad`).
      grad_reduce: the chosen ``grad_reduce``.
      num_microbatches: ``N``, as compiled.
      memory_budget: the budget in bytes.
      rows: every combination compiled.
    """

    param_gather: str
    grad_reduce: str
    num_microbatches: int
    memory_budget: int
    rows: tuple[ModePlanRow, ...]

    def __str__(self) -> str:
        lines = [
            f"Sharded modes at num_microbatches={self.num_microbatches}, budget "
            f"{format_bytes(self.memory_budget)} per device -> param_gather="
            f"{self.param_gather!r}, grad_reduce={self.grad_reduce!r}",
            f"  {'param_gather':>12}  {'grad_reduce':>11}  {'per device':>10}  "
            f"{'temp':>10}  {'comm/window':>11}  fits",
        ]
        for row in self.rows:
            chosen = (row.param_gather, row.grad_reduce) == (
                self.param_gather,
                self.grad_reduce,
            )
            lines.append(
                f"{'>' if chosen else ' '} {row.param_gather:>12}  "
                f"{row.grad_reduce:>11}  {format_bytes(row.total_bytes):>10}  "
                f"{format_bytes(row.temp_bytes):>10}  "
                f"{format_bytes(row.window_bytes):>11}  {'yes' if row.fits else 'no'}"
            )
        return "\n".join(lines)


def plan_modes(
    fun: Fun,
    *args: PyTree,
    num_microbatches: int,
    memory_budget: int | float | str,
    mesh: Mesh | AbstractMesh | None = None,
    data_axis: DataAxis = "data",
    **shard_kwargs: Unpack[ModePlanKwargs],
) -> ModePlan:
    """Compares the ``param_gather`` x ``grad_reduce`` modes of a sharded step.

    Compiles ``jax.jit(jaxaccum.shard_value_and_grad(fun, num_microbatches,
    param_gather=..., grad_reduce=..., **shard_kwargs))`` for the four
    combinations of ``"window"`` and ``"microbatch"`` and reads, per device,
    its memory (``compiled.memory_analysis()``, which for a sharded program
    counts each device's shards) and the bytes its collectives move per window
    (the compiled HLO). Chooses the combination that moves the fewest bytes
    among those that fit (the fewer bytes on a tie in memory). With
    ``axis_name``, the one combination that window takes: ``"window"`` x
    ``"window"`` (FSDP parameters gathered once, reduce-scattered once).

    Args:
      fun: the loss function.
      *args: its arguments, sharded as in training (arrays, or
        ``jax.ShapeDtypeStruct`` values with a ``sharding``).
      num_microbatches: ``N``.
      memory_budget: per-device bytes or a string such as ``"16GiB"``.
      mesh: the mesh; by default the one set with ``jax.set_mesh``.
      data_axis: the mesh axis (or axes) the batch is sharded over, as for
        :func:`jaxaccum.shard_value_and_grad`.
      **shard_kwargs: other keyword arguments of
        :func:`jaxaccum.shard_value_and_grad` (``reduction``,
        ``gather_dtype``, ``axis_name``, ...).

    Returns:
      A :class:`ModePlan`.

    Raises:
      ValueError: if no combination fits (with the table).
    """
    chosen = "plan_modes compiles every param_gather x grad_reduce combination itself."
    WindowSpec.check_keywords(
        "plan_modes",
        shard_kwargs,
        ModePlanKwargs,
        refused={
            "param_gather": chosen,
            "grad_reduce": chosen,
            "loss_scale": NO_LOSS_SCALE,
            "microbatch_size": "plan_modes compares windows of num_microbatches "
            "micro-batches: pass num_microbatches (the batch size over "
            "microbatch_size).",
        },
    )
    budget = parse_memory_budget(memory_budget)
    rows = []
    for gather, reduce in _modes(shard_kwargs.get("axis_name")):
        step = shard_value_and_grad(
            fun,
            num_microbatches,
            mesh=mesh,
            data_axis=data_axis,
            param_gather=gather,
            grad_reduce=reduce,
            **shard_kwargs,
        )
        compiled = jax.jit(step).lower(*args).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            raise ValueError(
                f"The {jax.default_backend()} backend gives no memory "
                "analysis for compiled programs; plan_modes cannot measure."
            )
        total = total_bytes(analysis)
        rows.append(
            ModePlanRow(
                gather,
                reduce,
                total,
                analysis.temp_size_in_bytes,
                window_bytes(compiled, num_microbatches),
                total <= budget,
            )
        )
    fitting = [row for row in rows if row.fits]
    result = ModePlan("", "", num_microbatches, budget, tuple(rows))
    if not fitting:
        raise ValueError(
            f"No mode fits memory_budget={format_bytes(budget)} per device; "
            "raise num_microbatches (less activation memory) or the budget.\n"
            + str(result)
        )
    best = min(fitting, key=lambda row: (row.window_bytes, row.total_bytes))
    return dataclasses.replace(
        result, param_gather=best.param_gather, grad_reduce=best.grad_reduce
    )


def _modes(axis_name: object) -> list[tuple[ShardMode, ShardMode]]:
    """The combinations compiled: all four, or with ``axis_name`` the one
    its window takes."""
    if axis_name is not None:
        return [("window", "window")]
    modes: tuple[ShardMode, ...] = ("window", "microbatch")
    return [(gather, reduce) for gather in modes for reduce in modes]
