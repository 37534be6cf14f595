"""A memory budget in bytes, read from what a user writes: a number, a string
with a unit (``"2GiB"``, ``"1.5 GB"``) or ``"device"``."""

import fractions
import math
import numbers
import re

import jax
import numpy as np

UNITS = {
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


BUDGET_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


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
            return device_budget()
        match = BUDGET_PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(
                f"Cannot read memory_budget={memory_budget!r}: write a "
                "non-negative number and a unit, such as '2GiB', '512MB' or "
                "'1.5GB', or pass 'device' or a number of bytes."
            )
        number, unit = match.groups()
        unit = unit or "b"
        if unit not in UNITS:
            raise ValueError(
                f"Unknown unit {unit!r} in memory_budget={memory_budget!r}. Use "
                "B, KB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, "
                "PiB (powers of 1024); e.g. write '2GB' or '2GiB', not '2G'."
            )
        budget = math.floor(fractions.Fraction(number) * UNITS[unit])
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


def device_budget() -> int:
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
