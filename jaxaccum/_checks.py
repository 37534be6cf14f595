"""The checks of what a user passes as a number: argument numbers, counts and
scalars (concrete or traced), each refusal naming the argument and the fix."""

import contextlib
import inspect
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._types import ArgNums, Fun


def argnums_tuple(name: str, argnums: ArgNums) -> tuple[int, ...]:
    """``argnums`` as a tuple of distinct non-negative ints, or a clear error."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for num in nums:
        if isinstance(num, bool) or not isinstance(num, int) or num < 0:
            raise TypeError(f"{name} must hold non-negative ints, got {argnums!r}.")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{name} has repeated entries: {argnums!r}.")
    return nums


# Counts live in int32 arrays (controller states, traced window lengths).
INT32_MAX = 2**31 - 1


# Real settings are computed with in float32: the magnitudes it keeps (normal).
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_positive_int(name: str, value: Any, why: str = "") -> None:
    """Checks that ``value`` is a positive Python (or NumPy) int that fits in
    int32; ``why`` follows the type error (why it cannot be a float or a
    traced value)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"{name} must be a positive Python int, got {value!r} of type "
            f"{type(value).__name__}.{' ' + why if why else ''}"
        )
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    if value > INT32_MAX:
        raise ValueError(
            f"{name} must be at most 2**31 - 1 = {INT32_MAX} (it is kept as an "
            f"int32), got {value}."
        )


def range_text(low: float | None, high: float | None, open_low: bool) -> str:
    if high is not None:
        return f"from {low} to {high}"
    if low is None:
        return "finite"
    return f"{'>' if open_low else '>='} {low}"


def check_scalar(
    name: str,
    value: Any,
    *,
    integer: bool,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    hint: str = "",
) -> None:
    """Checks a numeric argument: a Python, NumPy or JAX scalar (shape
    ``()``), an integer (``integer``) or a real number, not a bool, finite and
    in ``[low, high]`` (``(low, high]`` with ``open_low``). Integers are at
    most ``2**31 - 1`` (counts are kept as int32); reals keep their value in
    float32, where jaxaccum computes with them (no overflow to infinity, no
    underflow to 0). A traced value is checked for its dtype and shape only:
    its value is not known.

    Raises:
      TypeError: for a value of another type, dtype or shape, naming ``name``.
      ValueError: for a concrete value out of range, naming ``name``, the
        value and the range; ``hint`` (what to pass) ends both messages.
    """
    kind = "an integer scalar" if integer else "a real scalar"
    allowed = range_text(low, high, open_low)
    suffix = f" {hint}" if hint else ""
    is_number = isinstance(value, numbers.Number) or hasattr(value, "dtype")
    if isinstance(value, bool | np.bool_) or not is_number:
        shown = (
            f"{value!r} of type {type(value).__name__}"
            if isinstance(value, str | bool | np.bool_)
            else f"a {type(value).__name__}"
        )
        raise TypeError(f"{name} must be {kind} ({allowed}), got {shown}.{suffix}")
    dtype, shape = jnp.result_type(value), jnp.shape(value)
    wanted = (jnp.integer,) if integer else (jnp.integer, jnp.floating)
    if shape != () or not any(jnp.issubdtype(dtype, kind_) for kind_ in wanted):
        shown = (
            f"{value!r}"
            if isinstance(value, numbers.Number)
            else f"an array of dtype {dtype} and shape {shape}"
        )
        raise TypeError(f"{name} must be {kind} ({allowed}), got {shown}.{suffix}")
    if isinstance(value, jax.core.Tracer):
        return
    number = value.item() if hasattr(value, "item") else value
    if not math.isfinite(number):
        raise ValueError(
            f"{name} must be a finite number ({allowed}), got {number!r}.{suffix}"
        )
    in_range = (low is None or number > low or (number == low and not open_low)) and (
        high is None or number <= high
    )
    if not in_range:
        raise ValueError(f"{name} must be {allowed}, got {number!r}.{suffix}")
    if integer and number > INT32_MAX:
        raise ValueError(
            f"{name} must be at most 2**31 - 1 = {INT32_MAX} (it is kept as an "
            f"int32), got {number}.{suffix}"
        )
    if not integer and number and not (FLOAT32_TINY <= abs(number) <= FLOAT32_MAX):
        lost = "infinite" if abs(number) > FLOAT32_MAX else "0 (or lose precision)"
        zero = low is None or low < 0 or (low == 0 and not open_low)
        raise ValueError(
            f"{name} must be {'0 or ' if zero else ''}of magnitude from "
            f"{FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}, got {number!r}: jaxaccum "
            f"computes with it in float32, where it would become {lost}.{suffix}"
        )


def static_scalar(
    name: str,
    value: Any,
    *,
    integer: bool,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    hint: str = "",
) -> Any:
    """:func:`check_scalar` for a setting fixed when a program is built (a
    controller's field, a jit-static argument): it must be concrete, and is
    returned as a Python ``int`` or ``float``, so that it hashes as jit's
    static arguments need (a 0-d NumPy or JAX value does not).

    Raises:
      TypeError: for a traced value, or as :func:`check_scalar`.
      ValueError: as :func:`check_scalar`.
    """
    check_scalar(
        name, value, integer=integer, low=low, high=high, open_low=open_low, hint=hint
    )
    suffix = f" {hint}" if hint else ""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value: it is fixed "
            f"when the program is built. Pass a Python or NumPy number.{suffix}"
        )
    number = value.item() if hasattr(value, "item") else value
    return int(number) if integer else float(number)


def check_accum_dtype(name: str, value: Any) -> None:
    """Checks that an accumulation dtype is a floating dtype or None.

    Raises:
      TypeError: naming ``name``, for a value that is no dtype (a misspelt
        name) or one that is not floating (an integer dtype would sum float
        gradients as they are, a complex one would make them complex).
    """
    if value is None:
        return
    fix = (
        "Pass a floating dtype (jnp.float32, the default; jnp.float64 with "
        "jax_enable_x64) or None to keep every leaf's own dtype."
    )
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} is not a dtype. {fix}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name}={dtype} is not a floating dtype: gradients "
            f"accumulate in at least {name}. {fix}"
        )


def check_count(name: str, value: Any) -> None:
    """Checks that a micro-batch count or size is a positive Python int."""
    check_positive_int(
        name,
        value,
        "It fixes the compiled loop's length, so it cannot be a traced or float value.",
    )


def candidate_counts(candidates: Any, each: str) -> list[int]:
    """A planner's ``candidates`` as a list, each a count (:func:`check_count`,
    named ``each``); a value that is not an iterable of them is refused, saying
    what it got."""
    values = None
    if not isinstance(candidates, str | bytes):
        with contextlib.suppress(TypeError):  # not iterable: an int, a 0-d array
            values = list(candidates)
    if values is None:
        one = ""
        if type(candidates) is int or isinstance(candidates, np.integer):
            one = f" (for one: candidates=[{candidates!r}])"
        raise TypeError(
            f"candidates must be an iterable of positive ints, e.g. [2, 4, 8], "
            f"or None, got {candidates!r} of type {type(candidates).__name__}"
            f"{one}."
        )
    for num in values:
        check_count(each, num)
    return values


def check_accepts_example_mask(fun: Fun) -> None:
    """With ``pad``, ``fun`` is called with ``example_mask=``: it must take it."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function)
        return
    if any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD
        or (
            parameter.name == "example_mask"
            and parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
        )
        for parameter in parameters
    ):
        return
    name = getattr(fun, "__qualname__", repr(fun))
    raise TypeError(
        f"pad=True calls fun with the keyword argument example_mask (a boolean "
        f"(micro-batch size,) array, False on padded rows), but {name} does not "
        "accept it. Add `example_mask` to its signature and apply it to the "
        "losses and weights, e.g. jaxaccum.masked_sum(losses, example_mask)."
    )
