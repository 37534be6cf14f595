"""The pipeline's planner: :func:`plan_pipeline`, the window's ``M`` (and
``remat`` and the schedule) for a memory budget, from the compiled step.

At a fixed batch a larger ``M`` is both a smaller bubble and less memory
(smaller micro-batches), so "the smallest bubble that fits" would always be
micro-batches of one row. The planner holds the micro-batch fixed instead
(the size a device computes efficiently) and grows the window: each ``M``
compiles the step on ``M`` such micro-batches, GPipe's memory grows with
``M`` while the bubble ``(S - 1) / (M R + S - 1)`` shrinks, ``remat``
buys a larger ``M`` for a recomputed forward pass, and 1F1B's memory stops
growing from ``M = 2 S - 1`` on. It returns the fitting configuration whose
stage work is most useful (:func:`efficiency`).
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from typing_extensions import Unpack

from jaxaccum._checks import candidate_counts
from jaxaccum._pipeline._calls import takes_key
from jaxaccum._pipeline._layout import prepare, resolve_mesh, unpack_params
from jaxaccum._pipeline._plan_result import (
    PipelinePlan,
    PipelinePlanRow,
    efficiency,
    nothing_fits,
)
from jaxaccum._pipeline._schedules import SCHEDULES, builds, schedule_on, schedule_type
from jaxaccum._pipeline._spec import PIPELINE_REFUSED, PipelineLayout, PipelineWindow
from jaxaccum._pipeline._step import make_pipeline
from jaxaccum._plan._memory_budget import parse_memory_budget
from jaxaccum._plan._plan import total_bytes
from jaxaccum._types import (
    Batch,
    Fun,
    Params,
    PipelinePlanKwargs,
    PyTree,
    ScheduleName,
    StageOrder,
)
from jaxaccum._window import _split
from jaxaccum._window._spec import NO_LOSS_SCALE

_ASSUMED_RECOMPUTE = 1 / 3  # a backward pass twice the forward's FLOPs


def plan_pipeline(
    stage_fn: Fun,
    loss_fn: Fun,
    params: Params,
    microbatch: PyTree,
    *,
    memory_budget: int | float | str,
    mesh: Mesh | AbstractMesh | None = None,
    embed_fn: Fun | None = None,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    repeats: int = 1,
    schedule: ScheduleName | None = None,
    stage_order: StageOrder = "model",
    candidates: Iterable[int] | None = None,
    key: PyTree = None,
    **options: Unpack[PipelinePlanKwargs],
) -> PipelinePlan:
    """Finds the window whose pipelined step fits a memory budget with the
    least idle and recomputed work: ``M``, the schedule and ``remat``.

    The micro-batch is held fixed and the window grows: for each candidate
    ``M``, each schedule (unless ``schedule=``) and ``remat`` False and True
    (unless ``remat=``), it compiles ``jax.jit(pipeline_value_and_grad(
    stage_fn, loss_fn, M, ...))`` on ``M`` micro-batches like ``microbatch``
    and reads its footprint per device from ``compiled.memory_analysis()``
    (nothing runs; bisecting over ``M``). Of those that fit it returns the
    most efficient (:func:`efficiency`: the schedule's idle slots and, with
    ``remat``, the stage's forward FLOPs again), GPipe on a tie. What is
    counted and why: [Pipeline](../guides/pipeline.md).

    Args:
      stage_fn: one stage, as for :func:`jaxaccum.pipeline_value_and_grad`.
      loss_fn: the micro-batch's loss, as there.
      params: ``(embed_params, stage_params, head_params)`` as the step takes
        them, arrays or ``jax.ShapeDtypeStruct`` values; their shardings
        count (place the stages over the stage axis, as for training).
      microbatch: one micro-batch of the whole mesh (its rows over every
        data shard); the window's batch repeats its leaves' rows ``M``
        times, sharded over ``data_axis`` on a concrete mesh.
      memory_budget: bytes, a string such as ``"2GiB"``, or ``"device"``
        (see :func:`jaxaccum.parse_memory_budget`).
      mesh: the mesh, as for :func:`jaxaccum.pipeline_value_and_grad`.
      embed_fn: the embedding, as there (None: the micro-batch is ``x``).
      stage_axis: the mesh axis of the stages, as there.
      data_axis: the mesh axis the batch is sharded over, or None, as there.
      repeats: stages per device, as there.
      schedule: the one schedule to plan; None: every one built for
        ``repeats`` (zero-bubble takes ``repeats=1`` only).
      stage_order: the stacked stages' order, as there: each schedule's
        program is compiled in it (``"device"``: nothing relaid out; the
        footprint depends on the shapes only, so one stack serves every
        schedule's plan, though each runs its own order).
      candidates: the ``M`` to consider (with ``repeats > 1``, GPipe skips
        those below ``S``, which interleaved 1F1B plans).
        Default: ``S, 2S, 4S, ..., 32S``.
      key: a PRNG key, if the functions take one.
      **options: the other options of
        :func:`jaxaccum.pipeline_value_and_grad` (``reduction``,
        ``accum_dtype``, ...); ``remat=`` plans that one only. Not
        ``loss_scale``: a loss scale changes neither memory nor the gradient.

    Returns:
      A :class:`PipelinePlan`: ``num_microbatches``, ``schedule`` and
      ``remat`` to build the step with, and the table of every compiled
      configuration.

    Raises:
      ValueError: if nothing fits (with the smallest footprint compiled and
        the table), a candidate is not a count, a leaf of ``microbatch`` has
        no leading axis of rows, or the budget is invalid.
      TypeError: if ``num_microbatches``, ``microbatch_size`` or
        ``loss_scale`` is passed, ``candidates`` is not an iterable, or
        ``params`` is not a sequence of 3.
    """
    _refuse_window_size(options)
    budget = parse_memory_budget(memory_budget)
    layout = PipelineLayout(
        stage_axis, data_axis, repeats, schedule or "gpipe", stage_order
    )
    base = _base_options(options, layout, schedule)
    remats = (base.remat,) if "remat" in options else (False, True)
    configs = _configs(remats, schedule, repeats)
    device_mesh = resolve_mesh(mesh, base)
    num_stages = device_mesh.shape[stage_axis]
    candidates = _check_candidates(candidates, num_stages, repeats, configs)
    params, rows = unpack_params(params), _rows(microbatch)  # before any compile
    functions = (stage_fn, loss_fn, embed_fn)
    first = _first_window(base, configs, num_stages, candidates[0])
    recompute, measured = _recompute(functions, first, mesh, params, microbatch, key)

    def efficiency_of(num: int, config: tuple) -> float | None:
        """The efficiency of ``M = num`` with ``config``; None if its
        schedule does not run that window (circular GPipe below ``S``)."""
        kind, remat = config
        if _refusal(kind, num_stages, num, repeats) is not None:
            return None
        ticks = schedule_type(kind, repeats).for_window(num_stages, num, repeats, remat)
        return efficiency(ticks, remat, recompute)

    def measure(num: int, config: tuple) -> PipelinePlanRow:
        kind, remat = config
        pipeline = dataclasses.replace(layout, schedule=kind)
        call = dataclasses.replace(
            base, num_microbatches=num, remat=remat, layout=pipeline
        )
        row = _measure(functions, call, mesh, (params, microbatch, key))
        ticks = schedule_type(kind, repeats).for_window(num_stages, num, repeats, remat)
        return dataclasses.replace(
            row,
            bubble=ticks.bubble_fraction,
            efficiency=efficiency(ticks, remat, recompute),
            fits=row.total_bytes <= budget,
        )

    chosen, ordered = _search(measure, efficiency_of, candidates, configs)
    if chosen is None:
        raise nothing_fits(ordered, budget)
    return PipelinePlan(
        num_microbatches=chosen.num_microbatches,
        schedule=chosen.schedule,
        remat=chosen.remat,
        microbatch_rows=rows,
        batch_size=chosen.batch_size,
        bubble=chosen.bubble,
        efficiency=chosen.efficiency,
        recompute=recompute,
        recompute_measured=measured,
        memory_budget=budget,
        footprint_bytes=chosen.total_bytes,
        rows=ordered,
    )


def _refuse_window_size(options: Mapping[str, Any]) -> None:
    """The window's size is the planner's to choose."""
    for name in ("num_microbatches", "microbatch_size"):
        if name in options:
            raise TypeError(
                f"plan_pipeline chooses the window's num_microbatches itself; "
                f"do not pass {name}. Give the micro-batch as `microbatch` and "
                "restrict M with candidates=[...]."
            )


def _base_options(
    options: Mapping[str, Any], layout: PipelineLayout, schedule: str | None
) -> PipelineWindow:
    """The options every compiled configuration starts from, checked before
    any compile: a given schedule must be built for ``layout.repeats``, and a
    loss scale is refused (it changes neither memory nor the gradient)."""
    if schedule is not None:
        schedule_type(schedule, layout.repeats)
    return PipelineWindow.create(
        "plan_pipeline",
        1,
        options,
        PipelinePlanKwargs,
        fixed={"layout": layout},
        refused={**PIPELINE_REFUSED, "loss_scale": NO_LOSS_SCALE},
    )


def _configs(remats: tuple, schedule: str | None, repeats: int) -> list[tuple]:
    """The ``(schedule, remat)`` pairs to plan, in the order searched: the
    given schedule, else every schedule built for ``repeats`` (GPipe, 1F1B,
    zero-bubble, v-zb, v-half), each with every one of ``remats`` it is built
    for (the V's: no remat)."""
    if schedule:
        schedules: list[str] = [schedule]
    else:
        schedules = [name for name in SCHEDULES if builds(name, repeats)]
    configs = [
        (kind, remat)
        for kind in schedules
        for remat in remats
        if _remat_builds(kind, repeats, remat)
    ]
    if not configs:  # the given schedule with none of remats: say why
        schedule_type(schedules[0], repeats).check_remat(remats[-1])
    return configs


def _remat_builds(kind: str, repeats: int, remat: Any) -> bool:
    """Whether ``schedule=kind`` is built for ``remat``."""
    try:
        schedule_type(kind, repeats).check_remat(remat)
    except ValueError:
        return False
    return True


def _search(
    measure: Callable[[int, tuple], PipelinePlanRow],
    efficiency_of: Callable[[int, tuple], float | None],
    candidates: list[int],
    configs: list[tuple],
) -> tuple[PipelinePlanRow | None, tuple[PipelinePlanRow, ...]]:
    """The most efficient configuration that fits (None if none) and every
    row compiled, by ``(schedule, remat)`` then ``M``. Memory grows with
    ``M``, so per ``(schedule, remat)`` the largest fitting ``M`` is bisected
    for, in the order given; a later one is compiled only at the ``M`` whose
    efficiency (known before compiling) could beat the best found; an ``M``
    whose efficiency is None (not run by that schedule) is skipped."""
    rows: dict[tuple[int, int], PipelinePlanRow] = {}
    chosen: PipelinePlanRow | None = None
    for choice, config in enumerate(configs):
        floor = -1.0 if chosen is None else chosen.efficiency
        efficiencies = [efficiency_of(m, config) for m in candidates]
        better = [i for i, e in enumerate(efficiencies) if e is not None and e > floor]

        def fits(at: int, better: list = better, choice: int = choice) -> bool:
            index = better[at]
            rows[choice, index] = measure(candidates[index], configs[choice])
            return rows[choice, index].fits

        found = _largest_fitting(len(better), fits)
        if found is not None:
            chosen = rows[choice, better[found]]
    return chosen, tuple(rows[at] for at in sorted(rows))


def _largest_fitting(count: int, fits: Callable[[int], bool]) -> int | None:
    """The largest index whose ``fits`` holds, ``fits`` false above some
    index: the last, else (if the first fits) by bisection; None if none."""
    if count == 0:
        return None
    if fits(count - 1):
        return count - 1
    if count == 1 or not fits(0):
        return None
    low, high = 0, count - 1  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _first_window(
    base: PipelineWindow, configs: list[tuple], num_stages: int, num: int
) -> PipelineWindow:
    """The window of ``num`` micro-batches whose stage cost is measured: the
    first planned schedule that runs it (circular GPipe does not below S)."""
    repeats = base.layout.repeats
    runs_first = next(
        kind for kind, _ in configs if _refusal(kind, num_stages, num, repeats) is None
    )
    return dataclasses.replace(
        base,
        num_microbatches=num,
        layout=dataclasses.replace(base.layout, schedule=runs_first),
    )


def _refusal(kind: str, num_stages: int, num: int, repeats: int) -> Exception | None:
    """Why ``schedule=kind`` does not run a window of ``num`` micro-batches,
    or None where it does."""
    try:
        schedule_type(kind, repeats).check_window(num_stages, num, repeats)
    except ValueError as error:
        return error
    return None


def _check_candidates(
    candidates: Any, num_stages: int, repeats: int, configs: list[tuple]
) -> list[int]:
    """The candidate ``M``, sorted and deduplicated; default ``S 2**k``. A
    candidate no planned schedule runs is refused with the first one's why
    (circular GPipe needs ``M >= S``; interleaved 1F1B runs any ``M``)."""
    if candidates is None:
        return [num_stages * 2**k for k in range(6)]
    candidates = candidate_counts(candidates, "each candidate num_microbatches")
    if not candidates:
        raise ValueError("candidates is empty; give at least one M, or None.")
    kinds = dict.fromkeys(kind for kind, _ in configs)
    for num in sorted(set(candidates)):
        refusals = [_refusal(kind, num_stages, num, repeats) for kind in kinds]
        if all(refusals):
            raise ValueError(
                f"candidate num_microbatches={num}: {refusals[0]} Drop it."
            )
    return sorted(set(candidates))


def _rows(microbatch: Batch) -> int:
    """Rows of ``microbatch``, checked as the core checks a batch: every leaf
    has a leading axis of rows, the same in each."""
    return _split.batch_size_of([("microbatch", microbatch)])


def _window_batch(
    microbatch: Batch, num: int, mesh: Any, data_axis: str | None
) -> PyTree:
    """Shapes of a batch of ``num`` micro-batches like ``microbatch``, sharded
    over ``data_axis`` on a concrete mesh (so each device counts its rows)."""
    sharding = None
    if isinstance(mesh, jax.sharding.Mesh):
        sharding = NamedSharding(mesh, PartitionSpec(data_axis))

    def window(leaf: PyTree) -> jax.ShapeDtypeStruct:
        shape = jnp.shape(leaf)
        return jax.ShapeDtypeStruct(
            (shape[0] * num, *shape[1:]), jnp.result_type(leaf), sharding=sharding
        )

    return jax.tree.map(window, microbatch)


def _measure(functions: tuple, options: PipelineWindow, mesh: Any, args: tuple):
    """Compiles the step of ``options`` on its window's batch; a row with
    its memory (the bubble and efficiency left for the caller)."""
    params, microbatch, key = args
    device_mesh = resolve_mesh(mesh, options)
    num = options.num_microbatches
    assert num is not None
    batch = _window_batch(microbatch, num, device_mesh, options.layout.data_axis)
    step = make_pipeline(functions, options, mesh)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(params, batch, key).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError(
            f"The {jax.default_backend()} backend gives no memory analysis for "
            "compiled programs, so plan_pipeline cannot measure the step."
        )
    return PipelinePlanRow(
        num_microbatches=num,
        schedule=options.layout.schedule,
        remat=options.remat,
        batch_size=num * _rows(microbatch),
        bubble=0.0,
        efficiency=0.0,
        temp_bytes=analysis.temp_size_in_bytes,
        total_bytes=total_bytes(analysis),
        compile_seconds=seconds,
        fits=False,
    )


def _recompute(
    functions: tuple,
    options: PipelineWindow,
    mesh: Any,
    params: Params,
    microbatch: Batch,
    key: Any,
) -> tuple[float, bool]:
    """A stage's forward FLOPs over its forward and backward FLOPs (what
    ``remat`` adds to a tick), from ``cost_analysis()`` of one stage on one
    micro-batch's activation; 1/3 and False where no FLOPs are counted."""
    stage_fn, num = functions[0], options.num_microbatches
    assert num is not None
    device_mesh = resolve_mesh(mesh, options)
    batch = _window_batch(microbatch, num, device_mesh, options.layout.data_axis)
    schedule = schedule_on(device_mesh, options)
    prepared = prepare(functions, options, mesh, (params, batch, key), schedule)
    stage_params, x = prepared.like[1], prepared.shapes.x
    keyword = {"key": key} if key is not None and takes_key(stage_fn) else {}

    def forward(p, x):
        return stage_fn(p, x, **keyword)

    def forward_and_backward(p, x):
        y, pullback = jax.vjp(forward, p, x)
        return pullback(y)

    flops = []
    for fn in (forward, forward_and_backward):
        cost = jax.jit(fn).lower(stage_params, x).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops.append(float((cost or {}).get("flops", 0.0)))
    if flops[0] <= 0 or flops[1] <= flops[0]:
        return _ASSUMED_RECOMPUTE, False
    return flops[0] / flops[1], True
