"""Memory planner: the fewest micro-batches whose compiled step fits a budget.

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
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import optax
from typing_extensions import Unpack

from jaxaccum._checks import argnums_tuple, candidate_counts
from jaxaccum._plan._hlo import slow_loop_convolutions
from jaxaccum._plan._memory_budget import parse_memory_budget
from jaxaccum._types import Fun, PlanKwargs, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window import _split
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import NO_LOSS_SCALE, WindowSpec


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
      slow_loop_convolutions: on CPU, the convolutions in the window's loop
        left in the layout XLA:CPU runs slowly (``conv_layout="traced"``).
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
    slow_loop_convolutions: int = 0


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
        table = header + "\n" + _format_rows(self.rows, self.num_microbatches)
        rows = {row.num_microbatches: row for row in self.rows}
        slow = rows[self.num_microbatches].slow_loop_convolutions
        if slow:
            table += (
                f"\nnote: {slow} convolution(s) in the window's loop run "
                "XLA:CPU's slow layout (conv_layout='traced'): expect the window "
                "several times slower than the full batch; conv_layout='auto' "
                "runs the full batch's kernels."
            )
        return table


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
    _refuse_window_size(value_and_grad_kwargs)
    budget = parse_memory_budget(memory_budget)
    # Validates argnums, batch_argnums and the rest once, before compiling.
    options = WindowSpec.create(
        "plan",
        1,
        value_and_grad_kwargs,
        PlanKwargs,
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


def _refuse_window_size(given: Mapping[str, Any]) -> None:
    """Refuses the options that fix the window, which plan chooses (``given``
    may hold keys its type does not list: a caller without a type checker)."""
    for name in ("num_microbatches", "microbatch_size"):
        if name in given:
            raise TypeError(
                f"plan chooses the number of micro-batches itself; do not pass "
                f"{name}. Restrict the choice with candidates=[...] instead."
            )
    if given.get("masked"):
        raise TypeError(
            "plan does not take masked=True: it compiles one program per "
            "candidate N, and a masked program holds the buffers of its largest "
            "window whatever active_microbatches is. Plan without masked, and "
            "build value_and_grad(fun, plan.num_microbatches, masked=True) "
            "with the N it chooses as the window's maximum."
        )


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
    options: WindowSpec,
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
    compiled = _compile(step, args, donate_argnums)
    analysis = compiled.memory_analysis()
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
        slow_loop_convolutions=(
            slow_loop_convolutions(compiled) if jax.default_backend() == "cpu" else 0
        ),
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
