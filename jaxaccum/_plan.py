"""Memory planner: the fewest micro-batches whose compiled step fits a budget,
and the sharded modes' memory and communication (:func:`plan_modes`).

Figures are per device: for sharded arguments ``memory_analysis()`` counts each
device's shards, so a parameter sharded over ``D`` devices counts ``1/D``.

Instead of running a step and shrinking the micro-batch after an out-of-memory
crash, :func:`plan` compiles the step ahead of time for candidate numbers of
micro-batches ``N`` and reads XLA's own account of the program's memory
(``compiled.memory_analysis()``), on any backend and without real data.

The footprint of one compiled step is::

    arguments + outputs + temporaries - aliased (donated) bytes

* arguments: every argument of the step (parameters, the whole batch, other
  arguments; with ``optimizer=`` also the optimizer state);
* outputs: the value, aux and gradients (with ``optimizer=``: the value, aux,
  updated parameters and optimizer state instead of the gradients);
* temporaries: activations, the scan's gradient accumulator, and everything
  else XLA allocates while the step runs;
* aliased: outputs written into donated argument buffers (with ``optimizer=``
  the parameters and optimizer state are donated, as in a usual train step),
  counted once rather than twice.

Not counted: compiled code, allocator fragmentation and other arrays alive at
the same time (a second copy of the parameters, prefetched batches), so leave
some headroom.
"""

import dataclasses
import fractions
import math
import numbers
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh
from typing_extensions import Unpack

from jaxaccum import _split
from jaxaccum._hlo import window_bytes
from jaxaccum._options import (
    NO_LOSS_SCALE,
    SHARD_OPTIONS,
    AccumOptions,
    argnums_tuple,
    candidate_counts,
)
from jaxaccum._shard import DataAxis, shard_value_and_grad
from jaxaccum._types import Fun, ModePlanKwargs, PlanKwargs, PyTree, ShardMode
from jaxaccum._value_and_grad import make_accumulated

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_BUDGET_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


@dataclasses.dataclass(frozen=True)
class MemoryPlanRow:
    """The compiled memory of the step at one number of micro-batches.

    Attributes:
      num_microbatches: ``N``.
      microbatch_size: examples per micro-batch, ``batch_size // N``.
      argument_bytes: bytes of the step's arguments.
      output_bytes: bytes of the step's outputs.
      temp_bytes: bytes of temporaries XLA allocates while the step runs.
      alias_bytes: bytes of outputs written into donated arguments.
      total_bytes: the footprint, ``argument + output + temp - alias``.
      compile_seconds: wall time to lower and compile the step.
      fits: whether ``total_bytes`` is within the budget.
    """

    num_microbatches: int
    microbatch_size: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    total_bytes: int
    compile_seconds: float
    fits: bool


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The result of :func:`plan`; ``print`` it for the table.

    Attributes:
      num_microbatches: the chosen ``N``; pass it to
        :func:`jaxaccum.value_and_grad`.
      microbatch_size: examples per micro-batch at the chosen ``N``.
      batch_size: the batch size, ``num_microbatches * microbatch_size``.
      memory_budget: the budget in bytes.
      footprint_bytes: the compiled footprint at the chosen ``N`` (bytes).
      rows: one row per compiled ``N``, in increasing ``N``.
      includes_optimizer: whether the optimizer update (and its state) was part
        of the compiled step.
    """

    num_microbatches: int
    microbatch_size: int
    batch_size: int
    memory_budget: int
    footprint_bytes: int
    rows: tuple[MemoryPlanRow, ...]
    includes_optimizer: bool = False

    def __str__(self) -> str:
        step = "grads + optimizer update" if self.includes_optimizer else "grads"
        header = (
            f"Memory plan ({step}): batch {self.batch_size}, budget "
            f"{format_bytes(self.memory_budget)} -> num_microbatches="
            f"{self.num_microbatches} (micro-batch {self.microbatch_size}), "
            f"footprint {format_bytes(self.footprint_bytes)}"
        )
        return header + "\n" + _format_rows(self.rows, self.num_microbatches)


def parse_memory_budget(memory_budget: int | float | str) -> int:
    """Returns a memory budget in bytes.

    Args:
      memory_budget: bytes (a positive number); a string of a number and a unit,
        decimal (``B``, ``KB``, ``MB``, ``GB``, ``TB``, ``PB``: powers of 1000)
        or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``: powers of 1024),
        case-insensitive, such as ``"2GiB"`` or ``"1.5 GB"``; or ``"device"``:
        the memory XLA's allocator may use on the first local device
        (``bytes_limit`` of ``memory_stats()``; not reported on CPU).

    Returns:
      The budget in whole bytes (fractions of a byte are dropped).

    Raises:
      ValueError: for an empty, negative, zero or unparsable budget, an unknown
        unit, or ``"device"`` on a device that reports no memory statistics.
      TypeError: for a budget that is neither a number nor a string.

    Examples:
      >>> import jaxaccum
      >>> jaxaccum.parse_memory_budget("512MB"), jaxaccum.parse_memory_budget("2GiB")
      (512000000, 2147483648)
      >>> jaxaccum.parse_memory_budget("1.5 gb")
      1500000000
    """
    if isinstance(memory_budget, np.ndarray | jax.Array) and memory_budget.shape == ():
        memory_budget = memory_budget.item()  # a 0-d NumPy or JAX number
    if isinstance(memory_budget, bool) or not isinstance(
        memory_budget, numbers.Real | str
    ):
        raise TypeError(
            "memory_budget must be a number of bytes, a string such as '2GiB' or "
            f"'512MB', or 'device'; got {memory_budget!r} of type "
            f"{type(memory_budget).__name__}."
        )
    if isinstance(memory_budget, str):
        text = memory_budget.strip().lower()
        if text == "device":
            return _device_budget()
        match = _BUDGET_PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(
                f"Cannot read memory_budget={memory_budget!r}: write a "
                "non-negative number and a unit, such as '2GiB', '512MB' or "
                "'1.5GB', or pass 'device' or a number of bytes."
            )
        number, unit = match.groups()
        unit = unit or "b"
        if unit not in _UNITS:
            raise ValueError(
                f"Unknown unit {unit!r} in memory_budget={memory_budget!r}. Use "
                "B, KB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, "
                "PiB (powers of 1024); e.g. write '2GB' or '2GiB', not '2G'."
            )
        budget = math.floor(fractions.Fraction(number) * _UNITS[unit])
    elif not math.isfinite(memory_budget):
        raise ValueError(f"memory_budget must be finite, got {memory_budget!r}.")
    else:
        budget = math.floor(memory_budget)
    if budget < 1:
        raise ValueError(
            f"memory_budget must be at least 1 byte, got {memory_budget!r} "
            f"({budget} bytes)."
        )
    return budget


def plan(
    fun: Fun,
    *args: PyTree,
    memory_budget: int | float | str,
    candidates: Iterable[int] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    **value_and_grad_kwargs: Unpack[PlanKwargs],
) -> MemoryPlan:
    """Finds the fewest micro-batches whose compiled step fits a memory budget.

    Compiles ``jax.jit(jaxaccum.value_and_grad(fun, N, **value_and_grad_kwargs))``
    for ``args`` and reads its footprint, arguments + outputs + temporaries -
    aliased bytes, from ``compiled.memory_analysis()``; nothing runs, so ``args``
    may be ``jax.ShapeDtypeStruct`` values. It compiles the smallest and the
    largest candidate, then bisects (at most ``ceil(log2(len(candidates))) + 2``
    compilations): the chosen ``N`` fits, and the next-smaller candidate, if
    any, was compiled and does not. What is counted, and where bisection can
    miss a smaller ``N``: [Planning memory](../guides/planning-memory.md).

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      *args: positional arguments of ``fun``: pytrees of arrays or of
        ``jax.ShapeDtypeStruct`` values. The batch size is read from the batch
        argument(s) (``batch_argnums``, default 1).
      memory_budget: bytes, a string such as ``"2GiB"`` or ``"512MB"``, or
        ``"device"`` (see :func:`parse_memory_budget`).
      candidates: the numbers of micro-batches to consider; each must divide
        the batch size. Default: every divisor of the batch size.
      optimizer: if given, the step compiled is a whole train step on the
        differentiated argument(s), ``optimizer.update`` and
        ``optax.apply_updates`` included, the parameters and the optimizer state
        (from ``optimizer.init``) donated: the state and the update count too.
      **value_and_grad_kwargs: the other keyword arguments of
        :func:`jaxaccum.value_and_grad` (``argnums``, ``batch_argnums``,
        ``remat``, ...), as the training step will use them.

    Returns:
      A :class:`MemoryPlan`: ``num_microbatches`` to pass to
      :func:`jaxaccum.value_and_grad`, and the table of every compiled ``N``.

    Raises:
      ValueError: if no candidate fits (with the smallest footprint found and
        the budget), a candidate does not divide the batch size, or the budget
        is invalid.
      TypeError: if ``num_microbatches``, ``microbatch_size`` or
        ``masked=True`` is passed.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def loss(w, x):
      ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
      >>> w = jax.ShapeDtypeStruct((64, 1024), jnp.float32)  # no data needed
      >>> x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
      >>> result = jaxaccum.plan(loss, w, x, memory_budget="8MiB")
      >>> result.num_microbatches * result.microbatch_size  # N: 4 on jax 0.10.2
      4096
      >>> result.footprint_bytes <= 8 * 2**20
      True
      >>> step = jax.jit(jaxaccum.value_and_grad(loss, result.num_microbatches))
    """
    for name in ("num_microbatches", "microbatch_size"):
        if name in value_and_grad_kwargs:
            raise TypeError(
                f"plan chooses the number of micro-batches itself; do not pass "
                f"{name}. Restrict the choice with candidates=[...] instead."
            )
    given: Mapping[str, Any] = value_and_grad_kwargs  # keys it does not take too
    if given.get("masked"):
        raise TypeError(
            "plan does not take masked=True: it compiles one program per "
            "candidate N, and a masked program holds the buffers of its largest "
            "window whatever active_microbatches is. Plan without masked, and "
            "build value_and_grad(fun, plan.num_microbatches, masked=True) "
            "with the N it chooses as the window's maximum."
        )
    budget = parse_memory_budget(memory_budget)
    # Validates argnums, batch_argnums and the rest once, before compiling.
    options = AccumOptions.create(
        "plan",
        1,
        value_and_grad_kwargs,
        refused={**SHARD_OPTIONS, "loss_scale": NO_LOSS_SCALE},
    )
    batch_nums = options.batch_nums
    if len(args) <= max(batch_nums):
        raise TypeError(
            f"plan got {len(args)} positional argument(s) for fun, but "
            f"batch_argnums={options.batch_argnums!r} needs at least "
            f"{max(batch_nums) + 1}."
        )
    batch_size = _split.batch_size_of([(f"args[{i}]", args[i]) for i in batch_nums])
    candidates = _check_candidates(candidates, batch_size)

    rows: dict[int, MemoryPlanRow] = {}

    def fits(index: int) -> bool:
        num = candidates[index]
        rows[num] = measure(fun, args, num, batch_size, budget, optimizer, options)
        return rows[num].fits

    if fits(0):
        chosen = 0
    elif len(candidates) == 1 or not fits(len(candidates) - 1):
        smallest = min(rows.values(), key=lambda row: row.total_bytes)
        raise ValueError(
            f"No number of micro-batches fits memory_budget="
            f"{format_bytes(budget)} ({budget} bytes): the smallest footprint "
            f"compiled is {format_bytes(smallest.total_bytes)} "
            f"({smallest.total_bytes} bytes) at num_microbatches="
            f"{smallest.num_microbatches} (micro-batch {smallest.microbatch_size})."
            " Raise the budget, use a smaller batch or model, or try remat=True.\n"
            + _format_rows(tuple(rows[num] for num in sorted(rows)), None)
        )
    else:
        # Invariant: candidates[low - 1] does not fit, candidates[high] fits.
        low, high = 1, len(candidates) - 1
        while low < high:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle + 1
        chosen = high
    num = candidates[chosen]
    return MemoryPlan(
        num_microbatches=num,
        microbatch_size=batch_size // num,
        batch_size=batch_size,
        memory_budget=budget,
        footprint_bytes=rows[num].total_bytes,
        rows=tuple(rows[num] for num in sorted(rows)),
        includes_optimizer=optimizer is not None,
    )


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
    among those that fit (the fewer bytes on a tie in memory).

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
        ``gather_dtype``, ...).

    Returns:
      A :class:`ModePlan`.

    Raises:
      ValueError: if no combination fits (with the table).
    """
    chosen = "plan_modes compiles every param_gather x grad_reduce combination itself."
    AccumOptions.check_keywords(
        "plan_modes",
        shard_kwargs,
        refused={
            "param_gather": chosen,
            "grad_reduce": chosen,
            "loss_scale": NO_LOSS_SCALE,
        },
    )
    budget = parse_memory_budget(memory_budget)
    rows = []
    modes: tuple[ShardMode, ...] = ("window", "microbatch")
    for gather in modes:
        for reduce in modes:
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


def _device_budget() -> int:
    device = jax.local_devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"memory_budget='device' needs the device's memory statistics, but "
            f"{device.platform} device {device} reports none (memory_stats() "
            f"returned {stats!r}; CPU devices never do). Pass the budget in "
            "bytes or as a string such as '2GiB'."
        )
    return int(stats["bytes_limit"])


def _check_candidates(candidates: Iterable[int] | None, batch_size: int) -> list[int]:
    """Returns the candidates sorted and deduplicated, each dividing the batch."""
    if candidates is None:
        return _split.divisors(batch_size)
    candidates = candidate_counts(candidates, "each candidate number of micro-batches")
    if not candidates:
        raise ValueError(
            "candidates is empty; give at least one number of micro-batches, or "
            f"None for every divisor of the batch size {batch_size}."
        )
    for num in candidates:
        if batch_size % num:
            raise ValueError(
                f"Candidate num_microbatches={num} does not divide the batch "
                f"size {batch_size}: plan compiles whole, equal micro-batches. "
                f"Choose candidates from {_split.divisors(batch_size)}."
            )
    return sorted(set(int(num) for num in candidates))


def _compile(fun: Fun, args: Sequence[Any], donate_argnums: tuple):
    """Lowers and compiles ``jax.jit(fun)`` for ``args``."""
    return jax.jit(fun, donate_argnums=donate_argnums).lower(*args).compile()


def measure(
    fun: Fun,
    args: Sequence[Any],
    num_microbatches: int,
    batch_size: int,
    budget: int,
    optimizer: optax.GradientTransformation | None,
    options: AccumOptions,
) -> MemoryPlanRow:
    """Compiles the step with ``num_microbatches`` and reads its memory; the
    one measurement behind every figure of a plan."""
    step = make_accumulated(
        fun, dataclasses.replace(options, num_microbatches=num_microbatches)
    )
    donate_argnums: tuple = ()
    if optimizer is not None:
        step, args, donate_argnums = train_step(step, args, optimizer, options.argnums)
    start = time.perf_counter()
    analysis = _compile(step, args, donate_argnums).memory_analysis()
    seconds = time.perf_counter() - start
    if analysis is None:
        raise ValueError(
            f"The {jax.default_backend()} backend gives no memory analysis for "
            "compiled programs, so plan cannot measure the step. Choose "
            "num_microbatches by hand on this backend."
        )
    total = total_bytes(analysis)
    return MemoryPlanRow(
        num_microbatches=num_microbatches,
        microbatch_size=batch_size // num_microbatches,
        argument_bytes=analysis.argument_size_in_bytes,
        output_bytes=analysis.output_size_in_bytes,
        temp_bytes=analysis.temp_size_in_bytes,
        alias_bytes=analysis.alias_size_in_bytes,
        total_bytes=total,
        compile_seconds=seconds,
        fits=total <= budget,
    )


def total_bytes(analysis: Any) -> int:
    """The footprint of a compiled program from its ``memory_analysis()``:
    arguments + outputs + temporaries - aliased (donated) bytes."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def train_step(
    value_and_grad_fun: Fun,
    args: Sequence[Any],
    optimizer: optax.GradientTransformation,
    argnums: int | Sequence[int],
) -> tuple[Fun, tuple, tuple[int, ...]]:
    """Wraps a gradient step into ``step(opt_state, *args)`` applying updates.

    Returns the step, its arguments (optimizer state shapes first) and the
    argument numbers to donate: the optimizer state and the parameters.
    """
    diff_nums = argnums_tuple("argnums", argnums)

    def params_of(call_args: Sequence[Any]) -> PyTree:
        params = tuple(call_args[i] for i in diff_nums)
        return params[0] if isinstance(argnums, int) else params

    def step(opt_state: Any, *call_args: PyTree) -> tuple:
        out, grads = value_and_grad_fun(*call_args)
        params = params_of(call_args)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return out, optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(optimizer.init, params_of(args))
    return step, (opt_state, *args), (0, *(1 + i for i in diff_nums))


def format_bytes(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps it >= 1, e.g. 9.1 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _format_rows(rows: Sequence[MemoryPlanRow], chosen: int | None) -> str:
    header = ("N", "micro-batch", "temp", "total", "compile s", "fits")
    table = [header] + [
        (
            str(row.num_microbatches),
            str(row.microbatch_size),
            format_bytes(row.temp_bytes),
            format_bytes(row.total_bytes),
            f"{row.compile_seconds:.2f}",
            ("yes" if row.fits else "no")
            + ("  <- chosen" if row.num_microbatches == chosen else ""),
        )
        for row in rows
    ]
    widths = [max(len(line[column]) for line in table) for column in range(5)]
    return "\n".join(
        "  ".join(
            [
                *(
                    cell.rjust(width)
                    for cell, width in zip(line[:5], widths, strict=True)
                ),
                line[5],
            ]
        )
        for line in table
    )
