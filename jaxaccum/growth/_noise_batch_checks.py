"""The checks of a :class:`NoiseScaleBatch`'s arguments and of the windows it
is given, each refusal naming the argument to change."""

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxaccum._checks import static_scalar
from jaxaccum.growth._base import static_count
from jaxaccum.growth._noise_batch_state import (
    MAX_HALF_LIFE_WINDOWS,
    MIN_EFFECTIVE_WINDOWS,
    MIN_HALF_LIFE_WINDOWS,
    STEPS_ONLY,
    NoiseScaleBatchState,
    Settings,
)


def static_step_cost(value: Any) -> float:
    """``step_cost`` as a Python float: ``>= 0``, or infinite (STEPS_ONLY)."""
    try:
        return static_scalar(
            "step_cost",
            value,
            integer=False,
            low=0.0,
            hint="Pass a cost in the controller's unit (examples, or tokens with "
            "tokens_per_example), or jaxaccum.growth.STEPS_ONLY for the largest "
            "window.",
        )
    except ValueError:
        if float(np.asarray(value)) == STEPS_ONLY:
            return STEPS_ONLY
        raise


def static_sizes(sizes: Any) -> tuple[int, ...]:
    """``sizes`` as a tuple of Python ints: a non-empty sequence of counts."""
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Iterable):
        raise TypeError(
            "sizes must be a sequence of window sizes (micro-batches), e.g. "
            f"(2, 4, 8), or None for every size; got {sizes!r}."
        )
    converted = tuple(
        static_count(f"sizes[{index}]", size) for index, size in enumerate(sizes)
    )
    if not converted:
        raise ValueError(
            "sizes is empty: pass the allowed window sizes (micro-batches), e.g. "
            "(2, 4, 8), or None for every size from min_microbatches to "
            "max_microbatches."
        )
    return converted


def check_size_range(controller: Settings) -> None:
    """``sizes`` must start at ``min_microbatches`` and stay within
    ``max_microbatches``; the message says which argument to change."""
    sizes = controller.possible_num_microbatches
    low, high = controller.min_microbatches, controller.max_microbatches
    fixes = []
    if sizes[0] != low:
        fixes.append(
            f"pass min_microbatches={sizes[0]}"
            if sizes[0] >= 2
            else "drop 1 (one micro-batch measures no noise scale)"
        )
    if sizes[-1] > high:
        fixes.append(f"pass max_microbatches={sizes[-1]}, or drop sizes above {high}")
    if fixes:
        raise ValueError(
            f"sizes must start at min_microbatches ({low}) and end at most at "
            f"max_microbatches ({high}), got {controller.sizes}: "
            f"{'; '.join(fixes)}."
        )


def check_half_life(controller: Settings) -> None:
    """Refuses a half-life under which the averages could never hold 4
    effective windows of the largest size (the window would never move), or
    could never take in one of the smallest (its weight 0 in float32)."""
    sizes, unit = controller.possible_num_microbatches, controller.unit
    largest = sizes[-1] * controller.microbatch_weight
    smallest = sizes[0] * controller.microbatch_weight
    half_life = controller.effective_half_life
    named = f"half_life={half_life:g}" + (
        " (the default, 8 largest windows)" if controller.half_life is None else ""
    )
    units = (
        ""
        if controller.tokens_per_example
        else "; if big_batch counts tokens, pass tokens_per_example"
    )
    if half_life < MIN_HALF_LIFE_WINDOWS * largest:
        keep = 2.0 ** (-largest / half_life)
        raise ValueError(
            f"{named} is too short for windows of up to {largest:g} {unit}: "
            "after windows of B the averages hold at most (1 + k) / (1 - k) "
            f"effective windows, k = 2**(-B / half_life), here "
            f"{(1 + keep) / (1 - keep):.2f}, and the controller moves from "
            f"{MIN_EFFECTIVE_WINDOWS:g} on: it would never move. Pass "
            f"half_life >= 2 largest windows = {2 * largest:g} {unit} (5.83 "
            f"effective windows), or smaller windows{units}."
        )
    if half_life > MAX_HALF_LIFE_WINDOWS * smallest:
        raise ValueError(
            f"{named} is too long for windows of {smallest:g} {unit}: their "
            "weight in the averages, 1 - 2**(-B / half_life), is 0 in float32, "
            "where the averages are kept, so they would never count. Pass "
            f"half_life <= 2**24 smallest windows = "
            f"{MAX_HALF_LIFE_WINDOWS * smallest:g} {unit}{units}."
        )


def check_window_unit(
    controller: Settings, state: NoiseScaleBatchState, big_batch: Any
) -> None:
    """Counting examples, a concrete window cannot hold more than its
    micro-batches' examples: more is another unit (tokens)."""
    num = state.num_microbatches
    if controller.tokens_per_example is not None or any(
        isinstance(value, jax.core.Tracer) for value in (big_batch, num)
    ):
        return
    examples = int(num) * controller.microbatch_size
    # A window's total is a float32 sum of its micro-batches' weights: allow
    # its rounding (2**-24 a term) with room to spare.
    if float(np.asarray(big_batch)) > examples * (1.0 + 2.0**-16):
        raise ValueError(
            f"stats.big_batch is {float(np.asarray(big_batch)):g}, more than the "
            f"{examples} examples of the window's {int(num)} micro-batches of "
            f"microbatch_size={controller.microbatch_size}: it counts another "
            "unit (tokens, with reduction='weighted'). Pass tokens_per_example= "
            "(the mean tokens per example) to NoiseScaleBatch, with step_cost "
            "and half_life in tokens; or, if the window ran larger micro-batches, "
            "the microbatch_size it ran."
        )
