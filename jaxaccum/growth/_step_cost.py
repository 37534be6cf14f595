"""Timing on the host: :func:`measure_step_cost` times the user's compiled
step at two window sizes and solves for the step's cost in examples,
:class:`StepCost`."""

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxaccum._checks import static_scalar
from jaxaccum.growth._base import static_count


class StepCost(NamedTuple):
    """A step's cost, from timing windows of two sizes of one program.

    Attributes:
      step_seconds: $t_\\text{step}$, a window's time beyond its examples'
        (the update, reductions, the host round trip).
      example_seconds: $t_\\text{example}$, one example's forward and
        backward.
      step_cost: ``step_seconds / example_seconds``, in examples: what
        :class:`NoiseScaleBatch` takes.
      step_cost_error: how far ``step_cost`` may be off, in examples: the
        scatter of the repeated timings (each size's median less its least)
        carried back to a window of no examples. :func:`measure_step_cost`
        raises rather than return a ``step_cost`` no larger than it.
    """

    step_seconds: float
    example_seconds: float
    step_cost: float
    step_cost_error: float


# Timings per size: the median of fewer is the least, or midway to one other.
_MIN_REPEATS = 3


def measure_step_cost(
    window_step: Callable[[int], Any],
    microbatch_size: int,
    num_microbatches: tuple[int, int],
    *,
    repeats: int = 7,
) -> StepCost:
    """Measures ``step_cost`` on the user's own compiled step.

    A window of ``N`` micro-batches of ``m`` examples takes
    $t_\\text{step} + N m\\, t_\\text{example}$; timing two sizes (the least
    of ``repeats`` calls each, alternated, after one call each to compile)
    solves for both. Time the whole training step (gradients, optimizer
    update, the controller), on the devices it will run on. $t_\\text{step}$
    is the line through the two timings extrapolated to a window of no
    examples, so it is precise when the small window is small: one or two
    micro-batches.

    Args:
      window_step: ``window_step(num)`` runs one training step whose window
        has ``num`` micro-batches (e.g. the masked program with
        ``active_microbatches=num``) and returns its outputs (blocked on).
      microbatch_size: examples per micro-batch (over all devices).
      num_microbatches: the two sizes ``(small, large)``, ``small < large``:
        ``small`` small, for a precise $t_\\text{step}$, ``large`` far from
        it, for a precise slope.
      repeats: calls per size, at least 3; the least time counts, the
        median's distance from it is the timing's scatter.

    Returns:
      A :class:`StepCost`.

    Raises:
      TypeError: for a ``window_step`` that is not callable, counts that are
        not ints, or ``num_microbatches`` not a pair.
      ValueError: for fewer than 3 ``repeats`` (no scatter to judge the
        result by); for sizes not two, or not increasing; when the larger
        window was not slower (timing noise: choose sizes further apart); when
        $t_\\text{step}$ is not resolved: no larger than the timing's scatter
        carried back to no examples (the message gives the bound: if it is
        small against your batch, pass ``step_cost=EXAMPLES_ONLY``; otherwise
        time a smaller window on a quieter machine).

    Examples:
      A stand-in step of 10 ms plus 0.1 ms an example (yours is a jitted
      train step, e.g. the masked program with ``active_microbatches=num``):

      >>> import time
      >>> import jaxaccum.growth
      >>> def window_step(num):
      ...     time.sleep(0.010 + num * 8 * 1e-4)
      >>> cost = jaxaccum.growth.measure_step_cost(window_step, 8, (1, 16))
      >>> 80 < cost.step_cost < 125  # 10 ms / 0.1 ms = 100 examples
      True
    """
    if not callable(window_step):
        raise TypeError(
            "window_step must be a function of the window's number of "
            f"micro-batches that runs one training step, got {window_step!r}."
        )
    microbatch_size = static_count("microbatch_size", microbatch_size)
    repeats = static_scalar(
        "repeats",
        repeats,
        integer=True,
        low=_MIN_REPEATS,
        hint="The least timing is the time and the median's distance from it the "
        "scatter: fewer than 3 timings give no scatter (one gives 0), so a "
        "hiccup would pass as the step's cost.",
    )
    small, large = _size_pair(num_microbatches)
    seconds: dict[int, list[float]] = {small: [], large: []}
    for num in seconds:
        jax.block_until_ready(window_step(num))
    for _ in range(repeats):
        for num in seconds:
            start = time.perf_counter()
            jax.block_until_ready(window_step(num))
            seconds[num].append(time.perf_counter() - start)
    return _solve_step_cost(
        seconds[small], seconds[large], small * microbatch_size, large * microbatch_size
    )


def _size_pair(num_microbatches: Any) -> tuple[int, int]:
    """``num_microbatches`` as two increasing Python ints, or a clear error."""
    shown = (
        "num_microbatches must be a pair (small, large) of increasing window "
        f"sizes, e.g. (1, 8), got {num_microbatches!r}"
    )
    try:
        sizes = tuple(num_microbatches)
    except TypeError:
        raise TypeError(f"{shown}.") from None
    if len(sizes) != 2:
        raise ValueError(f"{shown}: {len(sizes)} sizes.")
    small, large = (
        static_count(f"num_microbatches[{index}]", size)
        for index, size in enumerate(sizes)
    )
    if not small < large:
        raise ValueError(
            f"num_microbatches must be two increasing sizes, got {num_microbatches}."
        )
    return small, large


def _solve_step_cost(
    small_seconds: list[float],
    large_seconds: list[float],
    small_examples: int,
    large_examples: int,
) -> StepCost:
    """The line through the least time of each size: its slope
    ($t_\\text{example}$) and its value at no examples ($t_\\text{step}$),
    with that value's error from each size's scatter (median less least)."""
    small_time, large_time = min(small_seconds), min(large_seconds)
    example_seconds = (large_time - small_time) / (large_examples - small_examples)
    if example_seconds <= 0:
        raise ValueError(
            f"a window of {large_examples} examples took {large_time:.3g} s, no "
            f"more than one of {small_examples} ({small_time:.3g} s): timing "
            "noise. Choose sizes further apart or a larger microbatch_size."
        )
    step_seconds = small_time - small_examples * example_seconds
    span = large_examples - small_examples
    small_scatter = float(np.median(small_seconds)) - small_time
    large_scatter = float(np.median(large_seconds)) - large_time
    error = (small_scatter * large_examples + large_scatter * small_examples) / span
    if step_seconds <= error:
        bound = (max(step_seconds, 0.0) + error) / example_seconds
        raise ValueError(
            f"the step's cost is not resolved: extrapolated to no examples a "
            f"window takes {step_seconds:.3g} s, within the timing's scatter "
            f"({error:.3g} s), so it is at most about {bound:,.0f} examples. If "
            "that is small against your batch, pass step_cost=EXAMPLES_ONLY; "
            "otherwise time a smaller window (num_microbatches=(1, ...)) on a "
            "quieter machine."
        )
    return StepCost(
        step_seconds,
        example_seconds,
        step_seconds / example_seconds,
        error / example_seconds,
    )
