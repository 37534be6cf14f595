"""The fixed ramp: :class:`BatchRamp`, micro-batches per window by examples
seen, and its state :class:`BatchRampState`."""

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._checks import check_scalar, static_scalar
from jaxaccum.growth._base import (
    Controller,
    ExamplesSeen,
    WindowTotals,
    as_float32,
    check_big_batch,
    keep_if,
    static_count,
    window_is_valid,
)


class BatchRampState(NamedTuple):
    """The state of :class:`BatchRamp`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: the :class:`ExamplesSeen` (``.total``, the windows'
        ``big_batch`` summed).
      num_microbatches: int32, the next window's number of micro-batches.
    """

    examples_seen: ExamplesSeen
    num_microbatches: jax.Array


@dataclasses.dataclass(frozen=True)
class BatchRamp(Controller):
    """A fixed batch-size ramp: micro-batches per window by examples seen.

    The next window has ``schedule[k]`` micro-batches for the largest key
    ``k <= examples_seen``, counted after the window that just ended (a window
    that ends exactly on a key gives the next one its size). Examples seen are
    in the unit of ``WindowStats.big_batch`` (examples, or the tokens of
    ``reduction="weighted"``) and compared with the keys in float32: exact up
    to ``2**24``, to a relative ``2**-24`` beyond.

    Args:
      microbatch_size: examples per micro-batch, a positive int.
      schedule: examples seen -> micro-batches per window, a mapping such as
        ``{0: 1, 100_000: 2, 400_000: 8}`` or ``(examples_seen,
        num_microbatches)`` pairs; keys ints from 0 (beyond int32 too, up to
        float32's largest), values positive ints. Kept as pairs of Python
        ints sorted by key (the ramp is a static argument of its jitted update).

    Raises:
      TypeError: for a ``schedule`` that is neither a mapping nor pairs, or a
        key, value or ``microbatch_size`` that is not an int.
      ValueError: for a schedule not starting at 0, with a key twice, a
        non-positive value, a key float32 cannot hold, or two keys float32
        cannot tell apart; or a non-positive ``microbatch_size``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum, jaxaccum.growth
      >>> ramp = jaxaccum.growth.BatchRamp(8, {0: 1, 16: 2, 48: 4})
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> state, sizes = ramp.init(), []
      >>> for _ in range(5):
      ...     num = ramp.num_microbatches(state)
      ...     step = jaxaccum.value_and_grad(loss, num, report_stats=True)
      ...     _, stats = step(jnp.ones(2), jnp.ones((8 * num, 2)))
      ...     state = ramp.update(state, stats)
      ...     sizes.append(num)
      >>> sizes, float(state.examples_seen.total)
      ([1, 1, 2, 2, 4], 80.0)
    """

    schedule: Mapping[int, int] | Sequence[tuple[int, int]]

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "schedule", _static_schedule(self.schedule))

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size the ramp can ask for, ascending (to compile ahead)."""
        return tuple(sorted({value for _, value in _pairs(self)}))

    def init(self) -> BatchRampState:
        """The state before any window: 0 examples seen, the size at key 0 next."""
        first = jnp.asarray(_pairs(self)[0][1], jnp.int32)
        return BatchRampState(ExamplesSeen.zero(), first)

    def update(self, state: BatchRampState, stats: WindowTotals) -> BatchRampState:
        """Counts the window's ``stats.big_batch``; sets the next window's size.

        Jittable; it reads the scalar ``stats.big_batch`` only, and runs one
        compiled program for windows of every size.

        Args:
          state: the state the previous window left.
          stats: the window's :class:`jaxaccum.WindowStats`.

        Returns:
          The state after the window. A window whose ``big_batch`` is NaN,
          infinite or negative leaves it exactly as it was.

        Raises:
          ValueError: for a concrete ``stats.big_batch`` that is NaN, infinite
            or negative.
        """
        check_big_batch(stats.big_batch)
        return _ramp_update(self, state, as_float32(stats.big_batch))


def _pairs(ramp: BatchRamp) -> tuple[tuple[int, int], ...]:
    """The ramp's schedule as ``__post_init__`` keeps it: sorted pairs."""
    assert isinstance(ramp.schedule, tuple)
    return ramp.schedule


@functools.partial(jax.jit, static_argnums=0)
def _ramp_update(
    ramp: BatchRamp, state: BatchRampState, big_batch: jax.Array
) -> BatchRampState:
    seen = state.examples_seen.add(big_batch)
    keys = jnp.asarray([key for key, _ in _pairs(ramp)], jnp.float32)
    values = jnp.asarray([value for _, value in _pairs(ramp)], jnp.int32)
    index = jnp.searchsorted(keys, seen.total, side="right") - 1
    counted = BatchRampState(seen, values[index])
    return keep_if(window_is_valid(big_batch, seen), counted, state)


def _schedule_key(key: Any) -> int:
    """A schedule key (examples seen) as a Python int: an int, not above what
    float32, where examples seen are counted, holds."""
    if isinstance(key, bool | np.bool_) or not isinstance(key, int | np.integer):
        # A 0-d JAX int: checked as a count is.
        return static_scalar(
            "schedule key", key, integer=True, hint="Keys are examples seen: ints."
        )
    number = int(key)
    check_scalar(
        f"schedule key {number}",
        number,
        integer=False,
        hint="Examples seen are counted in float32.",
    )
    return number


def _schedule_entries(schedule: Any) -> list[tuple[Any, Any]]:
    """A mapping's items, or the pairs given, or a clear error."""
    if isinstance(schedule, Mapping):
        return list(schedule.items())
    shown = (
        "schedule must be a mapping examples seen -> micro-batches per window, "
        "e.g. {0: 1, 100_000: 2}, or (examples_seen, num_microbatches) pairs, "
        f"got {schedule!r}."
    )
    try:
        entries = [tuple(pair) for pair in schedule]
    except TypeError:
        raise TypeError(shown) from None
    if any(len(entry) != 2 for entry in entries):
        raise TypeError(shown)
    return [(key, value) for key, value in entries]


def _static_schedule(schedule: Any) -> tuple[tuple[int, int], ...]:
    """``(examples_seen, num_microbatches)`` pairs as Python ints, sorted by
    key and checked: keys from 0, distinct in float32; values positive counts."""
    pairs = sorted(
        ((_schedule_key(key), value) for key, value in _schedule_entries(schedule)),
        key=lambda pair: pair[0],
    )
    if not pairs:
        raise ValueError("schedule is empty; pass e.g. {0: 1, 100_000: 2}.")
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"schedule keys must be distinct, got {keys}.")
    if keys[0] != 0:
        raise ValueError(
            f"schedule must start at 0 examples seen, its first key is "
            f"{keys[0]}; add e.g. 0: 1 for the first windows."
        )
    _check_keys_distinct_in_float32(keys)
    hint = "It counts micro-batches: pass a positive int."
    return tuple(
        (key, static_count(f"schedule[{key}]", value, hint)) for key, value in pairs
    )


def _check_keys_distinct_in_float32(keys: list[int]) -> None:
    """Examples seen are compared with the keys in float32: two keys that
    round to one float32 would make one of them unreachable."""
    rounded = np.asarray(keys, np.float64).astype(np.float32)
    collisions = np.flatnonzero(np.diff(rounded) <= 0)
    if collisions.size:
        index = int(collisions[0])
        first, second = keys[index], keys[index + 1]
        raise ValueError(
            f"schedule keys {first} and {second} are the same number in float32, "
            "where examples seen are counted (integers are exact up to 2**24 = "
            f"16,777,216; near {first} float32 steps by "
            f"{float(np.spacing(rounded[index])):,.0f}): space them further apart."
        )
