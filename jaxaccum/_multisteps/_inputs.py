"""What a `MultiSteps` call is given, checked: the window's length, the
call's weight, and whether ``should_skip_update_fn`` drops it."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._checks import check_scalar, static_scalar
from jaxaccum._types import Fun, PyTree

EveryKSchedule = int | Callable[[jax.Array], jax.typing.ArrayLike]


def never_skip(
    updates: optax.Updates,
    gradient_step: jax.typing.ArrayLike,
    params: optax.Params | None,
) -> tuple[jax.Array, Any]:
    del updates, gradient_step, params
    return jnp.array(False), ()


def check_every_k(
    every_k: jax.typing.ArrayLike, source: str, hint: str
) -> jax.typing.ArrayLike:
    """Rejects a window length that is not an integer scalar, or a concrete
    one below 1; ``source`` names where it came from, ``hint`` the fix."""
    check_scalar(source, every_k, integer=True, low=1, hint=hint)
    return every_k


def check_weight(weight: PyTree) -> jax.Array:
    """Returns ``weight`` as a float32 scalar, or raises saying what is wrong
    (a concrete weight must be a finite number >= 0; a traced one that is not
    gives NaN, so the window it joins emits NaN)."""
    try:
        # A Python number as float32 (an int past int32 is still a weight).
        plain = isinstance(weight, int | float) and not isinstance(weight, bool)
        with np.errstate(over="ignore"):  # 1e300 is refused below, by name
            array = jnp.asarray(weight, jnp.float32 if plain else None)
    except TypeError as error:
        raise TypeError(
            f"weight must be a scalar number or array, got {type(weight).__name__}."
            " Pass the micro-batch's number of tokens (or examples) as a scalar."
        ) from error
    if array.shape != ():
        raise ValueError(
            f"weight must be a scalar (shape ()), got shape {array.shape}. "
            "Pass the micro-batch's total weight, e.g. mask.sum(), not the "
            "per-example weights."
        )
    if not jnp.issubdtype(array.dtype, jnp.number):
        raise TypeError(
            f"weight must be numeric, got dtype {array.dtype}. "
            "Pass e.g. mask.sum() or a float."
        )
    check_scalar(  # the value as passed: float32 would hide 1e300 and 1e-300
        "weight",
        weight,
        integer=False,
        low=0.0,
        hint="It is this call's share of the window (its tokens or examples).",
    )
    weight = array.astype(jnp.float32)
    # Traced, it cannot be checked: a negative or non-finite weight makes the
    # window's sums NaN, never a plausible gradient.
    return jnp.where(jnp.isfinite(weight) & (weight >= 0), weight, jnp.nan)


def check_schedule(every_k_schedule: Any) -> EveryKSchedule | None:
    """``every_k_schedule`` checked: a function, None, or a count (a Python
    int after the check)."""
    if every_k_schedule is None or callable(every_k_schedule):
        return every_k_schedule
    return static_scalar(
        "every_k_schedule",
        every_k_schedule,
        integer=True,
        low=1,
        hint="Pass an int or a function of gradient_step (calls per window; 1 "
        "steps on every call), or None with update(..., every_k=...) on every "
        "call.",
    )


def window_length(
    schedule: EveryKSchedule | None,
    gradient_step: jax.Array,
    every_k: jax.typing.ArrayLike | None,
) -> jax.typing.ArrayLike:
    """The current window's length: ``every_k`` if the call passes it, else
    the schedule's value at ``gradient_step``."""
    if every_k is not None:
        return check_every_k(
            every_k, "every_k", "Pass e.g. every_k=controller_state.num_microbatches."
        )
    if schedule is None:
        raise TypeError(
            "MultiSteps(every_k_schedule=None) takes the window length from "
            "each call: update(..., every_k=num_calls), e.g. "
            "every_k=controller_state.num_microbatches."
        )
    if isinstance(schedule, int):
        return schedule
    return check_every_k(
        schedule(gradient_step),
        "every_k_schedule(gradient_step)",
        "Return e.g. jnp.where(gradient_step < 100, 1, 4).",
    )


def call_skipped(
    should_skip_update_fn: Fun,
    updates: optax.Updates,
    gradient_step: jax.Array,
    params: optax.Params | None,
    weight: jax.Array | None,
) -> tuple[jax.Array, Any]:
    """Whether to drop this call, and the skip function's state."""
    should_skip, skip_state = should_skip_update_fn(updates, gradient_step, params)
    should_skip = jnp.asarray(should_skip)
    if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "should_skip_update_fn must return a boolean scalar first, got "
            f"dtype {should_skip.dtype} and shape {should_skip.shape}."
        )
    if weight is not None and should_skip_update_fn is not never_skip:
        # The skip function sees only the gradient; a NaN or inf weight
        # would poison the window just the same.
        should_skip = should_skip | ~jnp.isfinite(weight)
    return should_skip, skip_state


def refuse_axis_name(axis_name: Any, where: str) -> None:
    """``axis_name`` is not taken across calls (typed ``None`` so that a type
    checker flags it too).

    Raises:
      TypeError: saying why and what to use instead.
    """
    if axis_name is not None:
        raise TypeError(
            f"{where} takes no axis_name (got {axis_name!r}): its window is "
            "spread over calls, so a collective over it (a BatchNorm's "
            "statistics, an all_gather) cannot meet the micro-batches of "
            "calls not yet made. Give the whole window to one step: "
            "jaxaccum.value_and_grad(fun, N, axis_name=...) under jit."
        )
