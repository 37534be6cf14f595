"""What every batch-size controller shares: the protocol it follows, the
examples-seen counter in its state, the window totals it reads, and the checks
of its arguments and of a window's total.

- :class:`BatchSizeController`: ``init``, ``update``, ``num_microbatches``,
  ``effective_batch_size``, ``possible_num_microbatches``, on
  ``optax.StatefulSchedule``'s model; :class:`ControllerState`, what its
  state holds.
- :class:`ExamplesSeen`: the examples seen, a float32 count with Kahan's
  compensation (one sub-state, in every state that counts examples).
- :class:`WindowTotals`: the scalars of a window that the controllers read.
- ``Controller``: the base of the controllers (their ``microbatch_size`` and
  the two size readers, written once).
"""

import dataclasses
import math
from typing import Any, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._checks import check_scalar, static_scalar
from jaxaccum._types import PyTree


class WindowTotals(Protocol):
    """The scalars of a window that the controllers read: a
    :class:`jaxaccum.WindowStats` has them (and ``(N,)`` fields they ignore)."""

    @property
    def big_batch(self) -> jax.Array: ...

    @property
    def gradient_norm_sq(self) -> jax.Array: ...

    @property
    def gradient_noise_trace(self) -> jax.Array: ...


class NoiseEstimatesLike(Protocol):
    """Anything with a window's estimates: ``WindowStats``, ``NoiseEstimates``."""

    @property
    def gradient_norm_sq(self) -> jax.Array: ...

    @property
    def gradient_noise_trace(self) -> jax.Array: ...


class ExamplesSeen(NamedTuple):
    """The examples seen so far: a float32 sum with Kahan's compensation.

    In the unit of what is added (``WindowStats.big_batch``: examples, or the
    weight of ``reduction="weighted"``, tokens, say). The count stays within
    float32 rounding of the exact sum however many windows are added (a plain
    float32 sum drifts by up to one rounding a window): integer counts are
    exact up to ``2**24``. A pytree, part of each state that counts examples.

    Attributes:
      total: float32, the sum so far: what ramps and schedules read.
      error: float32, Kahan's compensation: the exact sum is
        ``total - error``.
    """

    total: jax.Array
    error: jax.Array

    def __float__(self) -> float:
        """``float(examples_seen)``: the total, as 0.1's states held it (a
        float32 scalar), for a concrete count."""
        return float(self.total)

    @classmethod
    def zero(cls) -> "ExamplesSeen":
        """No examples seen."""
        zero = jnp.zeros((), jnp.float32)
        return cls(zero, zero)

    def add(self, value: jax.typing.ArrayLike) -> "ExamplesSeen":
        """The sum with ``value`` added, by Kahan summation. It never steps
        back: a correction that would lower ``total`` (a window of 0 after one
        rounded up) stays in ``error`` instead, so the total is monotone."""
        value = jnp.asarray(value, jnp.float32)
        corrected = value - self.error
        total = self.total + corrected
        step_back = total < self.total
        error = jnp.where(
            step_back, self.error - value, (total - self.total) - corrected
        )
        return ExamplesSeen(jnp.where(step_back, self.total, total), error)


class ControllerState(Protocol):
    """What a controller's state holds, whatever else: a NamedTuple of arrays
    (a pytree: it jits, checkpoints and resumes with the training state)."""

    @property
    def examples_seen(self) -> ExamplesSeen: ...

    @property
    def num_microbatches(self) -> jax.Array: ...


StateT = TypeVar("StateT", bound=ControllerState)


class BatchSizeController(Protocol[StateT]):
    """A batch-size controller: sizes the next window from what the last one
    measured; small, pure, its state a pytree (``optax.StatefulSchedule``'s
    model). :class:`BatchRamp` and :class:`NoiseScaleBatch` follow it.

    Examples:
      >>> import jaxaccum.growth
      >>> def first_window(controller: jaxaccum.growth.BatchSizeController) -> int:
      ...     return controller.num_microbatches(controller.init())
      >>> first_window(jaxaccum.growth.BatchRamp(8, {0: 2, 64: 4}))
      2
    """

    @property
    def microbatch_size(self) -> int:
        """Examples per micro-batch."""
        ...

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size it can ask for, ascending (to compile ahead)."""
        ...

    def init(self) -> StateT:
        """The state before any window."""
        ...

    def update(self, state: StateT, stats: WindowTotals) -> StateT:
        """The state after a window (jittable): counts its ``big_batch`` and
        sets the next window's ``num_microbatches``."""
        ...

    def num_microbatches(self, state: StateT) -> int:
        """The next window's number of micro-batches, a Python int."""
        ...

    def effective_batch_size(self, state: StateT) -> int:
        """The next window's ``num_microbatches * microbatch_size``."""
        ...


COUNT_HINT = "Pass a positive int (a count), not a float or a traced value."


def static_count(name: str, value: Any, hint: str = COUNT_HINT) -> int:
    """A count fixed when the program is built, as a Python int (hashable)."""
    return static_scalar(name, value, integer=True, low=1, hint=hint)


def static_bool(name: str, value: Any) -> bool:
    """A switch fixed when the program is built: a Python or NumPy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{name} must be True or False, got {value!r} of type "
            f"{type(value).__name__}."
        )
    return bool(value)


def static_positive(name: str, value: Any, hint: str) -> float:
    """A positive real setting fixed when the program is built, a Python float."""
    return static_scalar(name, value, integer=False, low=0.0, open_low=True, hint=hint)


def as_float32(value: Any) -> jax.Array:
    return jnp.asarray(value, jnp.float32)


def check_reading(name: str, value: Any, hint: str) -> None:
    """A measured real scalar (an estimate, a noise scale), checked as
    :func:`check_scalar` checks a real one, except that NaN and infinities,
    which measurements give (no estimate yet, an overflow), pass."""
    try:
        check_scalar(name, value, integer=False, hint=hint)
    except ValueError:
        if math.isfinite(float(np.asarray(value))):
            raise


def check_big_batch(big_batch: Any) -> None:
    """Raises for a concrete window total that no window can have."""
    if isinstance(big_batch, jax.core.Tracer):
        return
    value = np.asarray(big_batch)
    if value.shape != ():
        raise ValueError(
            f"stats.big_batch must be a scalar, got shape {value.shape}; pass "
            "the window's WindowStats."
        )
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(
            f"stats.big_batch must be a finite number >= 0, got {float(value)}: "
            "a window's total weight. A MultiSteps window's stats are NaN until "
            "it ends: update under `MultiSteps.has_updated(state)`. Traced, "
            "such a window leaves the state as it was."
        )


def window_is_valid(big_batch: jax.Array, seen: ExamplesSeen) -> jax.Array:
    """A window that can be counted: a finite total >= 0, a finite count."""
    return jnp.isfinite(big_batch) & (big_batch >= 0) & jnp.isfinite(seen.total)


def keep_if(valid: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``valid``, else ``old``, leaf by leaf (a traced guard)."""
    return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, old)


@dataclasses.dataclass(frozen=True)
class Controller:
    """The base of the controllers: ``microbatch_size`` (checked, a Python
    int) and the readers of the next window's size, from a state's
    ``num_microbatches``. A controller is a static argument of its jitted
    update, so every field is kept as a Python number (hashable)."""

    microbatch_size: int

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "microbatch_size",
            static_count("microbatch_size", self.microbatch_size),
        )

    def num_microbatches(self, state: ControllerState) -> int:
        """The next window's number of micro-batches, a Python int (it blocks
        until the state is computed)."""
        return int(state.num_microbatches)

    def effective_batch_size(self, state: ControllerState) -> int:
        """The next window's ``num_microbatches * microbatch_size`` (examples)."""
        return self.num_microbatches(state) * self.microbatch_size
