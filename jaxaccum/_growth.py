"""Growing the batch: controllers that size the next window, and a learning
rate that follows the batch.

A controller turns what one window measured (its :class:`jaxaccum.WindowStats`)
into the number of micro-batches of the next one. Its state is a NamedTuple of
arrays, so it jits, checkpoints (orbax) and resumes with the rest of the
training state; the host reads the next size one window ahead, for its data
loader. Two controllers:

* :func:`batch_ramp`: a fixed ramp indexed by examples seen.
* :func:`noise_scale_batch`: grows the window towards the gradient noise scale
  ``B_noise = tr(Sigma) / |G|^2`` it measures, grow-only, by doubling.

Both count ``examples_seen`` in the unit of ``WindowStats.big_batch``:
examples, or with ``reduction="weighted"`` the weight the loss returns (tokens,
say), the unit the noise scale comes in. The count is float32 with Kahan's
compensation, so it stays within float32 rounding of the exact count however
many windows are added (a plain float32 sum drifts by up to one rounding per
window): integer counts are exact up to ``2**24``.

:func:`scale_by_batch_learning_rate` is the Optax half: an update scaled by
``schedule(examples_seen) * rule(batch_size / base_batch)``, all traced, so a
change of batch size recompiles nothing.
"""

import dataclasses
import functools
import math
import time
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._noise_scale import (
    NoiseEstimates,
    NoiseScaleEMA,
    NoiseScaleState,
    check_decay,
)
from jaxaccum._options import check_scalar, static_scalar

LearningRateRule = Literal["sqrt", "linear", "none", "adascale"]
"""How the learning rate follows the batch: ``"sqrt"`` (Adam-type optimizers),
``"linear"`` (SGD), ``"none"``, or ``"adascale"`` (the AdaScale gain from the
measured noise, for SGD); see :func:`batch_scale`."""
LEARNING_RATE_RULES: tuple[str, ...] = typing.get_args(LearningRateRule)


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


def _add_compensated(
    total: jax.Array, error: jax.Array, value: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``total + value`` by Kahan summation: ``error`` carries what float32
    rounding dropped so far (the exact sum is ``total - error``). The total
    never steps back: a correction that would lower it (a window of 0 after
    one rounded up) stays in ``error`` instead, so ``examples_seen`` is
    monotone whatever the windows."""
    corrected = value - error
    new_total = total + corrected
    step_back = new_total < total
    new_error = jnp.where(step_back, error - value, (new_total - total) - corrected)
    return jnp.where(step_back, total, new_total), new_error


def _float32(value: Any) -> jax.Array:
    return jnp.asarray(value, jnp.float32)


_COUNT_HINT = "Pass a positive int (a count), not a float or a traced value."


def _static_count(name: str, value: Any, hint: str = _COUNT_HINT) -> int:
    """A count fixed when the program is built, as a Python int (hashable)."""
    return static_scalar(name, value, integer=True, low=1, hint=hint)


def _static_bool(name: str, value: Any) -> bool:
    """A switch fixed when the program is built: a Python or NumPy bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{name} must be True or False, got {value!r} of type "
            f"{type(value).__name__}."
        )
    return bool(value)


def _check_reading(name: str, value: Any, hint: str) -> None:
    """A measured real scalar (an estimate, a noise scale), checked as
    :func:`check_scalar` checks a real one, except that NaN and infinities,
    which measurements give (no estimate yet, an overflow), pass."""
    try:
        check_scalar(name, value, integer=False, hint=hint)
    except ValueError:
        if math.isfinite(float(np.asarray(value))):
            raise


class BatchRampState(NamedTuple):
    """The state of :class:`BatchRamp`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: float32, the sum of the windows' ``big_batch`` so far.
      examples_seen_error: float32, Kahan's compensation of that sum (the
        exact count is ``examples_seen - examples_seen_error``).
      num_microbatches: int32, the next window's number of micro-batches.
    """

    examples_seen: jax.Array
    examples_seen_error: jax.Array
    num_microbatches: jax.Array


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    """A batch-size ramp indexed by examples seen; build it with :func:`batch_ramp`.

    Attributes:
      microbatch_size: examples per micro-batch (for ``effective_batch_size``).
      schedule: ``(examples_seen, num_microbatches)`` pairs, sorted, the
        first at 0 examples.
    """

    microbatch_size: int
    schedule: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        # Stored as Python ints: the ramp is a static argument of its jitted
        # update, and a NumPy or JAX scalar field would not hash.
        object.__setattr__(
            self,
            "microbatch_size",
            _static_count("microbatch_size", self.microbatch_size),
        )
        object.__setattr__(self, "schedule", _static_schedule(self.schedule))

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size the ramp can ask for, ascending (to compile ahead)."""
        return tuple(sorted({int(value) for _, value in self.schedule}))

    def init(self) -> BatchRampState:
        """The state before any window: 0 examples seen, ``schedule[0]`` next."""
        zero = jnp.zeros((), jnp.float32)
        first = jnp.asarray(self.schedule[0][1], jnp.int32)
        return BatchRampState(zero, zero, first)

    def update(self, state: BatchRampState, stats: WindowTotals) -> BatchRampState:
        """Counts the window's ``stats.big_batch``; sets the next window's size.

        Jittable. It reads the scalar ``stats.big_batch`` only and runs one
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
        _check_big_batch(stats.big_batch)
        return _ramp_update(self, state, _float32(stats.big_batch))

    def num_microbatches(self, state: BatchRampState) -> int:
        """The next window's number of micro-batches, a Python int (blocks)."""
        return int(state.num_microbatches)

    def effective_batch_size(self, state: BatchRampState) -> int:
        """The next window's ``num_microbatches * microbatch_size``."""
        return self.num_microbatches(state) * self.microbatch_size


def _schedule_key(key: Any) -> int:
    """A schedule key (examples seen) as a Python int: an int, not above what
    float32, where examples seen are counted, holds."""
    if isinstance(key, bool | np.bool_) or not isinstance(key, int | np.integer):
        # A 0-d JAX int (a BatchRamp built directly): checked as a count is.
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


def _static_schedule(schedule: Any) -> tuple[tuple[int, int], ...]:
    """``(examples_seen, num_microbatches)`` pairs as Python ints, checked:
    keys increasing from 0 and distinct in float32, values positive counts."""
    try:
        entries = [tuple(pair) for pair in schedule]
    except TypeError:
        entries = [()]
    if any(len(entry) != 2 for entry in entries):
        raise TypeError(
            "schedule must be (examples_seen, num_microbatches) pairs, e.g. "
            f"((0, 1), (100_000, 2)), got {schedule!r}."
        )
    pairs = [(_schedule_key(key), value) for key, value in entries]
    if not pairs:
        raise ValueError("schedule is empty; pass e.g. {0: 1, 100_000: 2}.")
    keys = [key for key, _ in pairs]
    if keys != sorted(set(keys)):
        raise ValueError(f"schedule keys must increase, got {keys}.")
    if keys[0] != 0:
        raise ValueError(
            f"schedule must start at 0 examples seen, its first key is "
            f"{keys[0]}; add e.g. 0: 1 for the first windows."
        )
    _check_keys_distinct_in_float32(keys)
    hint = "It counts micro-batches: pass a positive int."
    return tuple(
        (key, _static_count(f"schedule[{key}]", value, hint)) for key, value in pairs
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


@functools.partial(jax.jit, static_argnums=0)
def _ramp_update(
    ramp: BatchRamp, state: BatchRampState, big_batch: jax.Array
) -> BatchRampState:
    seen, error = _add_compensated(
        state.examples_seen, state.examples_seen_error, big_batch
    )
    keys = jnp.asarray([key for key, _ in ramp.schedule], jnp.float32)
    values = jnp.asarray([value for _, value in ramp.schedule], jnp.int32)
    index = jnp.searchsorted(keys, seen, side="right") - 1
    counted = BatchRampState(seen, error, values[index])
    valid = _window_is_valid(big_batch, seen)
    return jax.tree.map(lambda a, b: jnp.where(valid, a, b), counted, state)


def batch_ramp(microbatch_size: int, schedule: Mapping[int, int]) -> BatchRamp:
    """A fixed batch-size ramp: micro-batches per window by examples seen.

    The next window has ``schedule[k]`` micro-batches for the largest key
    ``k <= examples_seen``, counted after the window that just ended (so a
    window that ends exactly on a key already gives the next one its size).
    ``examples_seen`` is in the unit of ``WindowStats.big_batch``: examples, or
    the weight (tokens) of ``reduction="weighted"``. Keys are compared in
    float32: exact up to ``2**24``, to a relative ``2**-24`` beyond.

    Args:
      microbatch_size: examples per micro-batch, a positive int.
      schedule: examples seen -> micro-batches per window, e.g.
        ``{0: 1, 100_000: 2, 400_000: 8}``; keys ints starting at 0 (beyond
        int32 too: up to float32's largest), values positive ints. NumPy and
        0-d JAX ints are kept as Python ints.

    Returns:
      A :class:`BatchRamp` (``init``, ``update``, ``num_microbatches``).

    Raises:
      TypeError: for a ``schedule`` that is not a mapping, a key or value
        that is not an int, or a ``microbatch_size`` that is not an int.
      ValueError: for a schedule not starting at 0, with a non-positive
        value, a key float32 cannot hold or two keys float32 cannot tell
        apart (examples seen are counted in float32), or a non-positive
        ``microbatch_size``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> ramp = jaxaccum.batch_ramp(8, {0: 1, 16: 2, 48: 4})
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> state, sizes = ramp.init(), []
      >>> for _ in range(5):
      ...     num = ramp.num_microbatches(state)
      ...     step = jaxaccum.value_and_grad(loss, num, report_stats=True)
      ...     _, stats = step(jnp.ones(2), jnp.ones((8 * num, 2)))
      ...     state = ramp.update(state, stats)
      ...     sizes.append(num)
      >>> sizes, float(state.examples_seen)
      ([1, 1, 2, 2, 4], 80.0)
    """
    if not isinstance(schedule, Mapping):
        raise TypeError(
            "schedule must be a mapping examples seen -> micro-batches per window, "
            f"e.g. {{0: 1, 100_000: 2}}, got {schedule!r}."
        )
    pairs = [(_schedule_key(key), value) for key, value in schedule.items()]
    return BatchRamp(microbatch_size, tuple(sorted(pairs, key=lambda pair: pair[0])))


class NoiseMoments(NamedTuple):
    """Moving averages over examples seen of the windows' noise estimates.

    A window of ``B`` examples (in the unit of ``big_batch``) multiplies the old
    sums by $2^{-B/h}$ (half-life $h$) and adds its estimates with weight
    $1 - 2^{-B/h}$: the average spans the same examples whatever the windows'
    size. Divide a sum by ``weight`` for its bias-corrected average.

    Attributes:
      weight: float32, the windows' total weight, $1 - 2^{-E/h}$ after $E$
        examples.
      weight_sq: float32, the sum of their squared weights, decayed alike:
        ``weight**2 / weight_sq`` is the effective number of windows.
      norm_sq: float32, the weighted sum of the $|G|^2$ estimates.
      trace: float32, the weighted sum of the $\\operatorname{tr}(\\Sigma)$
        estimates.
      norm_sq_squared: float32, of the squared $|G|^2$ estimates.
      trace_squared: float32, of the squared $\\operatorname{tr}(\\Sigma)$
        estimates.
      norm_sq_trace: float32, of their products.
      num_windows: int32, the windows folded in (those with finite estimates).
    """

    weight: jax.Array
    weight_sq: jax.Array
    norm_sq: jax.Array
    trace: jax.Array
    norm_sq_squared: jax.Array
    trace_squared: jax.Array
    norm_sq_trace: jax.Array
    num_windows: jax.Array


def _init_moments() -> NoiseMoments:
    zero = jnp.zeros((), jnp.float32)
    return NoiseMoments(
        zero, zero, zero, zero, zero, zero, zero, zero.astype(jnp.int32)
    )


def _fold_moments(
    moments: NoiseMoments,
    big_batch: jax.Array,
    norm_sq: jax.Array,
    trace: jax.Array,
    half_life: float,
) -> NoiseMoments:
    """The moments with one window's estimates; unchanged if any result is
    not finite (a NaN estimate, one micro-batch, an overflow)."""
    keep = jnp.exp2(-big_batch / half_life)
    new = 1.0 - keep
    values: tuple[Any, ...] = (
        1.0,
        norm_sq,
        trace,
        norm_sq**2,
        trace**2,
        norm_sq * trace,
    )
    sums: tuple[jax.Array, ...] = (moments.weight, *moments[2:7])
    weight, *averaged = [
        keep * old + new * value for old, value in zip(sums, values, strict=True)
    ]
    weight_sq = keep**2 * moments.weight_sq + new**2
    candidate = NoiseMoments._make(
        [weight, weight_sq, *averaged, moments.num_windows + 1]
    )
    usable = jnp.all(jnp.stack([jnp.isfinite(v) for v in candidate[:7]]))
    return jax.tree.map(lambda a, b: jnp.where(usable, a, b), candidate, moments)


class NoiseReading(NamedTuple):
    """What the moments say: the inverse noise scale and its standard error.

    Attributes:
      inverse_noise_scale: float32, $\\phi = \\overline{|G|^2} /
        \\overline{\\operatorname{tr}(\\Sigma)} = 1 / B_\\text{noise}$ (NaN
        before any window; may be $\\le 0$: the signal lost in the noise).
      standard_error: float32, of $\\phi$ by the delta method from the
        windows' spread (inf with fewer than two effective windows).
      effective_windows: float32, ``weight**2 / weight_sq``.
    """

    inverse_noise_scale: jax.Array
    standard_error: jax.Array
    effective_windows: jax.Array


def _read_moments(moments: NoiseMoments) -> NoiseReading:
    weight = moments.weight
    norm_sq, trace = moments.norm_sq / weight, moments.trace / weight
    phi = norm_sq / trace
    # Var(|G|^2 - phi tr(Sigma)) over windows; its mean is 0 by phi's choice.
    spread = (
        moments.norm_sq_squared
        - 2 * phi * moments.norm_sq_trace
        + phi**2 * moments.trace_squared
    ) / weight
    effective = weight**2 / moments.weight_sq
    error = jnp.sqrt(jnp.maximum(spread, 0.0) / (effective - 1.0)) / trace
    error = jnp.where((effective > 1.0) & (trace > 0), error, jnp.inf)
    return NoiseReading(phi, error, effective)


class NoiseScaleBatchState(NamedTuple):
    """The state of :class:`NoiseScaleBatch`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: float32, the sum of the windows' ``big_batch`` so far.
      examples_seen_error: float32, Kahan's compensation of that sum.
      num_microbatches: int32, the next window's number of micro-batches.
      microbatches_seen: int32, the sum of the windows' sizes; with
        ``examples_seen`` it gives a micro-batch's weight in the noise
        scale's unit (``examples_seen / microbatches_seen``).
      noise: the :class:`NoiseMoments` of the estimates.
    """

    examples_seen: jax.Array
    examples_seen_error: jax.Array
    num_microbatches: jax.Array
    microbatches_seen: jax.Array
    noise: NoiseMoments


EXAMPLES_ONLY = 0.0
"""``step_cost`` of a step that costs nothing beyond its examples: the best
window is the smallest that measures."""
STEPS_ONLY = math.inf
"""``step_cost`` of a step that costs more than any window's examples: the best
window is the largest."""
# Fewer windows' spread is no measure of the error: a band from 2 or 3 of them
# is as often too narrow as right.
_MIN_EFFECTIVE_WINDOWS = 4.0


@dataclasses.dataclass(frozen=True)
class NoiseScaleBatch:
    """Sizes the window for the least predicted time from the measured noise
    scale and the step's cost; see :func:`noise_scale_batch` for the rule.

    Every quantity with a unit is in one unit, the controller's: examples, or
    tokens (the unit of ``WindowStats.big_batch`` with ``reduction="weighted"``)
    when ``tokens_per_example`` is set. The fields are validated and stored as
    Python numbers (the controller is a static argument of its jitted update).

    Attributes:
      microbatch_size: examples per micro-batch.
      max_microbatches: the largest window.
      min_microbatches: the smallest window.
      step_cost: a step's fixed cost in the controller's unit,
        ``t_step / t_example``.
      kappa: if set, the target is $\\kappa B_\\text{noise}$ instead
        (step_cost unused).
      half_life: of the moving averages, in the controller's unit.
      standard_errors: how far (in standard errors of the estimate) the
        evidence must put the target from the current window to move it.
      sizes: the allowed window sizes.
      shrink: whether the window may shrink (with 2x hysteresis).
      tokens_per_example: ``None``: ``big_batch`` counts examples. Otherwise
        ``big_batch``, ``step_cost`` and ``half_life`` count tokens, and a
        micro-batch is ``microbatch_size * tokens_per_example`` of them.
    """

    microbatch_size: int
    max_microbatches: int
    min_microbatches: int = 2
    step_cost: float = 1024.0
    kappa: float | None = None
    half_life: float | None = None
    standard_errors: float = 1.0
    sizes: tuple[int, ...] | None = None
    shrink: bool = False
    tokens_per_example: float | None = None

    def __post_init__(self) -> None:
        set_field = functools.partial(object.__setattr__, self)
        for name in ("microbatch_size", "max_microbatches", "min_microbatches"):
            set_field(name, _static_count(name, getattr(self, name)))
        if self.min_microbatches < 2:
            raise ValueError(
                f"min_microbatches must be >= 2, got {self.min_microbatches}: a "
                "window of one micro-batch measures no noise scale."
            )
        if self.max_microbatches < self.min_microbatches:
            raise ValueError(
                f"max_microbatches ({self.max_microbatches}) must be >= "
                f"min_microbatches ({self.min_microbatches})."
            )
        set_field("step_cost", _static_step_cost(self.step_cost))
        for name, hint in (
            ("kappa", "The target is kappa * B_noise."),
            ("tokens_per_example", "The mean tokens (weight) of an example."),
            ("half_life", "In the controller's unit (examples, or tokens)."),
        ):
            if getattr(self, name) is not None:
                positive = static_scalar(
                    name,
                    getattr(self, name),
                    integer=False,
                    low=0.0,
                    open_low=True,
                    hint=hint,
                )
                set_field(name, positive)
        set_field(
            "standard_errors",
            static_scalar(
                "standard_errors", self.standard_errors, integer=False, low=0.0
            ),
        )
        set_field("shrink", _static_bool("shrink", self.shrink))
        if self.sizes is not None:
            set_field("sizes", _static_sizes(self.sizes))
        _check_size_range(self)
        _check_half_life(self)

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size it can ask for, ascending: ``sizes``, by default
        every int from ``min_microbatches`` to ``max_microbatches``."""
        if self.sizes is not None:
            return tuple(sorted(set(self.sizes)))
        return tuple(range(self.min_microbatches, self.max_microbatches + 1))

    @property
    def unit(self) -> str:
        """The controller's unit: ``"examples"``, or ``"tokens"`` with
        ``tokens_per_example``."""
        return "examples" if self.tokens_per_example is None else "tokens"

    @property
    def microbatch_weight(self) -> float:
        """A micro-batch in the controller's unit: ``microbatch_size``
        examples, or ``microbatch_size * tokens_per_example`` tokens."""
        return self.microbatch_size * (self.tokens_per_example or 1.0)

    @property
    def effective_half_life(self) -> float:
        """``half_life``, by default 8 of the largest windows (in the
        controller's unit)."""
        if self.half_life is not None:
            return float(self.half_life)
        return 8.0 * self.max_microbatches * self.microbatch_weight

    @property
    def start_microbatches(self) -> int:
        """The first window: the allowed size of least predicted time if
        $B_\\text{noise}$ were the largest window's batch (with ``kappa``,
        ``min_microbatches``); see :func:`noise_scale_batch`."""
        if self.kappa is not None:
            return self.min_microbatches
        sizes = self.possible_num_microbatches
        if self.step_cost == EXAMPLES_ONLY:
            return sizes[0]
        if self.step_cost == STEPS_ONLY:
            return sizes[-1]
        # On the host (init may be traced): sizes and costs are static.
        batches = np.asarray(sizes, np.float64) * self.microbatch_weight
        steps = 1.0 / batches[-1] + 1.0 / batches
        return sizes[int(np.argmin(steps * (self.step_cost + batches)))]

    def init(self) -> NoiseScaleBatchState:
        """The state before any window: ``start_microbatches`` next."""
        zero = jnp.zeros((), jnp.float32)
        count = jnp.zeros((), jnp.int32)
        first = jnp.asarray(self.start_microbatches, jnp.int32)
        return NoiseScaleBatchState(zero, zero, first, count, _init_moments())

    def update(
        self, state: NoiseScaleBatchState, stats: WindowTotals
    ) -> NoiseScaleBatchState:
        """Folds in the window's estimates; may move the next window's size.

        Jittable. It reads the scalars ``stats.big_batch``,
        ``stats.gradient_norm_sq`` and ``stats.gradient_noise_trace`` only, and
        runs one compiled program for windows of every size. A window whose
        ``big_batch`` is not a finite number ``>= 0`` leaves the state exactly
        as it was (and raises when ``big_batch`` is concrete); one with
        non-finite estimates counts its examples and leaves the averages.

        Args:
          state: the state the previous window left (whose
            ``num_microbatches`` the window had).
          stats: the window's :class:`jaxaccum.WindowStats`.

        Returns:
          The state after the window.

        Raises:
          ValueError: for a concrete ``stats.big_batch`` that is NaN, infinite
            or negative; and, when the controller counts examples, for one
            larger than the window's examples (``state.num_microbatches *
            microbatch_size``): ``big_batch`` then counts tokens, and the
            controller needs ``tokens_per_example``.
        """
        _check_big_batch(stats.big_batch)
        _check_window_unit(self, state, stats.big_batch)
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return _noise_scale_update(self, state, *map(_float32, totals))

    def num_microbatches(self, state: NoiseScaleBatchState) -> int:
        """The next window's number of micro-batches, a Python int (blocks)."""
        return int(state.num_microbatches)

    def effective_batch_size(self, state: NoiseScaleBatchState) -> int:
        """The next window's ``num_microbatches * microbatch_size`` (examples)."""
        return self.num_microbatches(state) * self.microbatch_size

    def noise_scale(self, state: NoiseScaleBatchState) -> jax.Array:
        """The averaged $B_\\text{noise}$, in the unit of ``big_batch``; NaN
        before any window with finite estimates, negative or infinite where
        the averaged $|G|^2$ is not above 0 (the signal lost in the noise)."""
        moments = state.noise
        return moments.trace / moments.norm_sq

    def predicted_time(
        self, batch: jax.typing.ArrayLike, noise_scale: jax.typing.ArrayLike
    ) -> jax.Array:
        """McCandlish's time to a loss of a window of ``batch`` at a noise
        scale, in units of $S_\\min t_\\text{example}$:
        $(1 + B_\\text{noise} / B)(c + B)$ with $c$ the ``step_cost``;
        $1 + B_\\text{noise} / B$ (in units of $S_\\min t_\\text{step}$) for
        ``STEPS_ONLY``. A float32 scalar, traceable.

        A negative noise scale (what :meth:`noise_scale` reads where the
        averaged $|G|^2$ is below 0: the signal lost in the noise) counts as
        infinite, as the controller reads it: an infinite noise scale gives
        an infinite time. A NaN one (no estimate yet) gives NaN.

        Args:
          batch: the window, in the controller's unit (examples, or tokens
            with ``tokens_per_example``), a positive real scalar.
          noise_scale: $B_\\text{noise}$ in the same unit, a real scalar
            (NaN and infinities allowed).

        Returns:
          The predicted time, a float32 scalar.

        Raises:
          TypeError: for arguments that are not real scalars.
          ValueError: for a ``batch`` that is not a positive finite number,
            or a finite ``noise_scale`` beyond float32's range.

        Examples:
          >>> import jaxaccum
          >>> controller = jaxaccum.noise_scale_batch(8, 16, step_cost=64)
          >>> float(controller.predicted_time(64, 192))  # (1 + 3)(64 + 64)
          512.0
          >>> float(controller.predicted_time(64, float("inf")))
          inf
        """
        check_scalar(
            "batch",
            batch,
            integer=False,
            low=0.0,
            open_low=True,
            hint=f"Pass a window's size in {self.unit}.",
        )
        _check_reading(
            "noise_scale",
            noise_scale,
            hint=f"Pass B_noise in {self.unit}, e.g. controller.noise_scale(state).",
        )
        batch, noise_scale = _float32(batch), _float32(noise_scale)
        steps = jnp.where(noise_scale < 0, jnp.inf, 1.0 + noise_scale / batch)
        if self.step_cost == STEPS_ONLY:
            return steps
        return steps * (self.step_cost + batch)


def _static_step_cost(value: Any) -> float:
    """``step_cost`` as a Python float: ``>= 0``, or infinite (STEPS_ONLY)."""
    try:
        return static_scalar(
            "step_cost",
            value,
            integer=False,
            low=0.0,
            hint="Pass a cost in the controller's unit (examples, or tokens with "
            "tokens_per_example), or jaxaccum.STEPS_ONLY for the largest window.",
        )
    except ValueError:
        if float(np.asarray(value)) == STEPS_ONLY:
            return STEPS_ONLY
        raise


def _static_sizes(sizes: Any) -> tuple[int, ...]:
    """``sizes`` as a tuple of Python ints: a non-empty sequence of counts."""
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Iterable):
        raise TypeError(
            "sizes must be a sequence of window sizes (micro-batches), e.g. "
            f"(2, 4, 8), or None for every size; got {sizes!r}."
        )
    converted = tuple(
        _static_count(f"sizes[{index}]", size) for index, size in enumerate(sizes)
    )
    if not converted:
        raise ValueError(
            "sizes is empty: pass the allowed window sizes (micro-batches), e.g. "
            "(2, 4, 8), or None for every size from min_microbatches to "
            "max_microbatches."
        )
    return converted


def _check_size_range(controller: NoiseScaleBatch) -> None:
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


# The averages' effective windows, weight**2 / weight_sq, tend to
# (1 + k) / (1 - k) for windows of B with k = 2**(-B / half_life): the
# controller's _MIN_EFFECTIVE_WINDOWS = 4 needs k >= 3/5, half_life >= 1.36 B.
# Two largest windows give 5.83, reached after 5 windows.
_MIN_HALF_LIFE_WINDOWS = 2.0
# A window of B whose weight 1 - 2**(-B / half_life) float32 keeps above 0.
_MAX_HALF_LIFE_WINDOWS = 2.0**24


def _check_half_life(controller: NoiseScaleBatch) -> None:
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
    if half_life < _MIN_HALF_LIFE_WINDOWS * largest:
        keep = 2.0 ** (-largest / half_life)
        raise ValueError(
            f"{named} is too short for windows of up to {largest:g} {unit}: "
            "after windows of B the averages hold at most (1 + k) / (1 - k) "
            f"effective windows, k = 2**(-B / half_life), here "
            f"{(1 + keep) / (1 - keep):.2f}, and the controller moves from "
            f"{_MIN_EFFECTIVE_WINDOWS:g} on: it would never move. Pass "
            f"half_life >= 2 largest windows = {2 * largest:g} {unit} (5.83 "
            f"effective windows), or smaller windows{units}."
        )
    if half_life > _MAX_HALF_LIFE_WINDOWS * smallest:
        raise ValueError(
            f"{named} is too long for windows of {smallest:g} {unit}: their "
            "weight in the averages, 1 - 2**(-B / half_life), is 0 in float32, "
            "where the averages are kept, so they would never count. Pass "
            f"half_life <= 2**24 smallest windows = "
            f"{_MAX_HALF_LIFE_WINDOWS * smallest:g} {unit}{units}."
        )


def _check_window_unit(
    controller: NoiseScaleBatch, state: NoiseScaleBatchState, big_batch: Any
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
            "(the mean tokens per example) to noise_scale_batch, with step_cost "
            "and half_life in tokens; or, if the window ran larger micro-batches, "
            "the microbatch_size it ran."
        )


def _check_big_batch(big_batch: Any) -> None:
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


def _window_is_valid(big_batch: jax.Array, seen: jax.Array) -> jax.Array:
    """A window that can be counted: a finite total >= 0, a finite count."""
    return jnp.isfinite(big_batch) & (big_batch >= 0) & jnp.isfinite(seen)


def _scaled_time(
    controller: NoiseScaleBatch, batch: jax.Array, phi: jax.Array
) -> jax.Array:
    """The predicted time ``(1 + B_noise / B)(c + B)`` times ``phi =
    1 / B_noise`` (a factor common to every size, so the best size is the
    same), which stays finite for ``phi <= 0`` (an infinite noise scale)."""
    phi = jnp.maximum(phi, 0.0)
    steps = (phi * batch + 1.0) / batch
    if controller.step_cost == STEPS_ONLY:
        return steps
    return steps * (controller.step_cost + batch)


def _measured_microbatch_weight(state: NoiseScaleBatchState) -> jax.Array:
    count = jnp.maximum(state.microbatches_seen, 1).astype(jnp.float32)
    return state.examples_seen / count


def _best_size(
    controller: NoiseScaleBatch, phi: jax.Array, weight: jax.Array
) -> jax.Array:
    """The allowed size of least predicted time (nearest ``kappa B_noise`` in
    log with ``kappa``)."""
    sizes = jnp.asarray(controller.possible_num_microbatches, jnp.int32)
    batches = sizes.astype(jnp.float32) * weight
    if controller.kappa is not None:
        tiny = jnp.finfo(jnp.float32).tiny
        score = jnp.abs(jnp.log(batches * jnp.maximum(phi, tiny) / controller.kappa))
    elif controller.step_cost == EXAMPLES_ONLY:
        score = batches
    else:
        score = _scaled_time(controller, batches, phi)
    return sizes[jnp.argmin(score)]


def _next_size(controller: NoiseScaleBatch, state: NoiseScaleBatchState) -> jax.Array:
    """The window after ``state``'s: moved only where the evidence puts the
    target, $\\phi \\pm z\\,\\mathrm{se}$ apart, wholly on one side of it; to
    the end of that band nearest the current window."""
    reading = _read_moments(state.noise)
    band = controller.standard_errors * reading.standard_error
    weight = _measured_microbatch_weight(state)
    phi = reading.inverse_noise_scale
    # A larger phi (a smaller noise scale) is a smaller target.
    smallest = _best_size(controller, phi + band, weight)
    largest = _best_size(controller, phi - band, weight)
    window = state.num_microbatches
    grow = smallest > window
    shrink = controller.shrink & (2 * largest <= window)
    moved = jnp.where(grow, smallest, jnp.where(shrink, largest, window))
    return jnp.where(reading.effective_windows >= _MIN_EFFECTIVE_WINDOWS, moved, window)


@functools.partial(jax.jit, static_argnums=0)
def _noise_scale_update(
    controller: NoiseScaleBatch,
    state: NoiseScaleBatchState,
    big_batch: jax.Array,
    gradient_norm_sq: jax.Array,
    gradient_noise_trace: jax.Array,
) -> NoiseScaleBatchState:
    seen, error = _add_compensated(
        state.examples_seen, state.examples_seen_error, big_batch
    )
    window = state.num_microbatches
    noise = _fold_moments(
        state.noise,
        big_batch,
        gradient_norm_sq,
        gradient_noise_trace,
        controller.effective_half_life,
    )
    counted = NoiseScaleBatchState(
        seen, error, window, state.microbatches_seen + window, noise
    )
    counted = counted._replace(num_microbatches=_next_size(controller, counted))
    valid = _window_is_valid(big_batch, seen)
    return jax.tree.map(lambda a, b: jnp.where(valid, a, b), counted, state)


def noise_scale_batch(
    microbatch_size: int,
    max_microbatches: int,
    *,
    min_microbatches: int = 2,
    step_cost: float = 1024.0,
    kappa: float | None = None,
    half_life: float | None = None,
    standard_errors: float = 1.0,
    sizes: Sequence[int] | None = None,
    shrink: bool = False,
    tokens_per_example: float | None = None,
) -> NoiseScaleBatch:
    r"""Sizes each window for the least predicted time to the same progress.

    Under McCandlish et al.'s model, reaching a loss takes
    $S = S_\min (1 + B_\text{noise} / B)$ steps and
    $E = E_\min (1 + B / B_\text{noise})$ examples at batch $B$; with a step
    that costs $t_\text{step} + B\, t_\text{example}$ the time is
    $\propto (1 + B_\text{noise} / B)(c + B)$, $c = t_\text{step} /
    t_\text{example}$ the ``step_cost`` in examples, least at
    $B^* = \sqrt{c\, B_\text{noise}}$. The controller measures
    $B_\text{noise} = \operatorname{tr}(\Sigma) / |G|^2$ from the windows'
    estimates (see :class:`jaxaccum.WindowStats`) and moves to the allowed
    window of least predicted time. Its two limits: ``step_cost=0``
    (:data:`EXAMPLES_ONLY`, examples are all that cost) keeps the smallest
    window that measures; ``step_cost=math.inf`` (:data:`STEPS_ONLY`) takes
    the largest.

    The unit. Every quantity with a unit (``step_cost``, ``half_life``,
    $B_\text{noise}$, the windows) is in the unit of
    ``WindowStats.big_batch``: examples, or, with ``reduction="weighted"``,
    the weight the loss returns (tokens, say). Counting tokens, pass
    ``tokens_per_example`` (the mean tokens per example) and ``step_cost``
    and ``half_life`` in tokens: a micro-batch is then ``microbatch_size *
    tokens_per_example`` tokens for the start and the default half-life, and
    the run makes the same decisions as the same run counted in examples.
    Counting examples, a window whose ``big_batch`` exceeds its examples is
    refused (concrete) as a unit mix-up.

    The estimate. The $|G|^2$ and $\operatorname{tr}(\Sigma)$ estimates are
    averaged over examples seen, not windows: a window of $B$ examples
    decays the averages by $2^{-B/h}$ for a ``half_life`` $h$, so runs with
    different windows average over the same stretch of training and read the
    same $B_\text{noise}$ at the same examples seen. The averages hold
    ``weight**2 / weight_sq`` effective windows, at most $(1 + k) / (1 - k)$
    for windows of $B$, $k = 2^{-B/h}$, and the controller moves from 4 on:
    ``half_life`` must be at least 2 of the largest windows (5.83 effective
    windows at most, reached after 5 of them; shorter, a window of the
    largest size would never move).

    The start. With no estimate yet, the first window is the one of least
    predicted time if $B_\text{noise}$ were the largest window's batch
    $B_\max$: $\sqrt{c\, B_\max}$, the smallest window for
    ``step_cost=0``, the largest from $c \ge B_\max$ on. The largest window
    is the batch beyond which the user expects no gain, a guess at the noise
    scale, and the guess is cheap when wrong: the predicted time is flat near
    its optimum (a window 4x off costs 1.56x, 2x off 1.13x), whereas a run
    that starts at the smallest window and waits to learn its way up pays
    each step's cost on the smallest windows (on the benchmarks, 1.2-1.35x
    the best fixed window at ``step_cost=1024``).

    The moves. A window is moved as soon as the evidence excludes it: from
    4 effective windows on, the targets for $1/B_\text{noise} \pm z\,
    \mathrm{se}$ ($z$ = ``standard_errors``, the standard error by the delta
    method from the windows' spread) bound where the target can be; a window
    below both grows to the nearer bound, the smallest target the evidence
    allows. Moving to the near bound, not the estimate, keeps a grow-only
    window from following noise upwards; a rough early estimate is enough
    to move on, because the time is flat near the optimum.

    The defaults, and why:

    * ``step_cost=1024``: the middle, in log, of 64 (one device, a cheap
      update) to 16,384 (many hosts, a slow all-reduce). Wrong by a factor
      $r$, the window is off by $\sqrt{r}$ and the time at most
      $(2 + \sqrt{r} + 1/\sqrt{r}) / 4$ times the best: 1.13x for $r = 4$,
      1.56x for $r = 16$. Measure it with :func:`measure_step_cost`.
    * ``half_life``: 8 largest windows (in the controller's unit); short
      enough to follow a noise scale that grows as the loss falls, long
      enough for about 23 windows of the largest size in the average.
    * ``standard_errors=1``: one standard error; 0 moves to the estimate's
      target (with noisy windows, a grow-only window then ratchets up on
      noise), a wider band moves later and less far.
    * ``sizes``: every int from ``min_microbatches`` to ``max_microbatches``
      (one masked program); pass e.g. powers of two to compile fewer
      programs ahead.
    * ``shrink=False``: the noise scale grows as the loss falls, so a shrink
      mostly follows noise (on the benchmarks, shrinking from the start window
      early and growing back lost to staying); with ``shrink=True`` the window
      shrinks to the band's far bound once that is half the current size or
      less.

    A window whose ``big_batch`` is NaN, infinite or negative (a
    ``MultiSteps`` window read mid-window) leaves the state exactly as it
    was; ``examples_seen`` never becomes NaN. Windows with NaN or infinite
    estimates (one non-empty micro-batch, a non-finite gradient) count their
    examples and are left out of the averages.

    Args:
      microbatch_size: examples per micro-batch, a positive int.
      max_microbatches: the largest window, ``>= min_microbatches``.
      min_microbatches: the smallest window, ``>= 2`` (the first with
        ``kappa``).
      step_cost: $t_\text{step} / t_\text{example}$, in the controller's
        unit (examples, or tokens with ``tokens_per_example``): ``>= 0``, or
        ``math.inf``.
      kappa: if given, target $\kappa B_\text{noise}$ (McCandlish's
        critical batch for $\kappa = 1$) instead, nearest in log;
        ``step_cost`` is then unused.
      half_life: of the averages, in the controller's unit; at least 2
        largest windows, at most $2^{24}$ smallest ones (whose weight would
        be 0 in float32).
      standard_errors: the band's half-width, in standard errors; ``>= 0``.
      sizes: the allowed window sizes (micro-batches), from
        ``min_microbatches`` up to ``max_microbatches``.
      shrink: allow the window to shrink, with 2x hysteresis; a bool.
      tokens_per_example: ``None`` (``big_batch`` counts examples), or the
        mean tokens per example: ``big_batch``, ``step_cost`` and
        ``half_life`` then count tokens. Positive.

    Every number may be a Python, NumPy or concrete JAX scalar; the
    controller keeps Python numbers (it is a static argument of its jitted
    update).

    Returns:
      A :class:`NoiseScaleBatch` (``init``, ``update``, ``num_microbatches``,
      ``noise_scale``).

    Raises:
      TypeError: naming the argument, for a count that is not an int, a
        number that is not a concrete real scalar, ``shrink`` not a bool, or
        ``sizes`` not a sequence.
      ValueError: naming the argument, for ``min_microbatches < 2``,
        ``max_microbatches < min_microbatches``, a non-positive count,
        ``kappa``, ``half_life`` or ``tokens_per_example``, a negative
        ``step_cost`` or ``standard_errors``, a number float32 cannot hold,
        empty ``sizes`` or ``sizes`` outside the range (saying which
        argument to change), or a ``half_life`` out of its bounds.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> controller = jaxaccum.noise_scale_batch(
      ...     4, max_microbatches=16, step_cost=16, sizes=(2, 4, 8, 16)
      ... )
      >>> controller.start_microbatches  # sqrt(16 * 64) = 32 examples
      8
      >>> loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)
      >>> x = jax.random.normal(jax.random.key(0), (4096, 3))
      >>> steps = {  # one program per size the controller can ask for
      ...     num: jax.jit(jaxaccum.value_and_grad(loss, num, report_stats=True))
      ...     for num in controller.possible_num_microbatches
      ... }
      >>> state, sizes = controller.init(), []
      >>> for window in range(40):
      ...     num = controller.num_microbatches(state)  # known one window ahead
      ...     rows = x[window * 64 : window * 64 + num * 4]
      ...     _, stats = steps[num](jnp.ones(3) / 2, rows)
      ...     state = controller.update(state, stats)
      ...     sizes.append(num)
      >>> sizes[0], sizes[-1], sizes == sorted(sizes)
      (8, 8, True)

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training",
      https://arxiv.org/abs/1812.06162
    """
    return NoiseScaleBatch(
        microbatch_size,
        max_microbatches,
        min_microbatches,
        step_cost,
        kappa,
        half_life,
        standard_errors,
        sizes,  # type: ignore[arg-type]  # any sequence; stored as a tuple
        shrink,
        tokens_per_example,
    )


class StepCost(NamedTuple):
    """A step's cost, from timing windows of two sizes of one program.

    Attributes:
      step_seconds: $t_\\text{step}$, a window's time beyond its examples'
        (the update, reductions, the host round trip).
      example_seconds: $t_\\text{example}$, one example's forward and
        backward.
      step_cost: ``step_seconds / example_seconds``, in examples: what
        :func:`noise_scale_batch` takes.
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
      >>> import jaxaccum
      >>> def window_step(num):
      ...     time.sleep(0.010 + num * 8 * 1e-4)
      >>> cost = jaxaccum.measure_step_cost(window_step, 8, (1, 16))
      >>> 80 < cost.step_cost < 125  # 10 ms / 0.1 ms = 100 examples
      True
    """
    if not callable(window_step):
        raise TypeError(
            "window_step must be a function of the window's number of "
            f"micro-batches that runs one training step, got {window_step!r}."
        )
    microbatch_size = _static_count("microbatch_size", microbatch_size)
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
        _static_count(f"num_microbatches[{index}]", size)
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


def _check_rule(rule: str) -> None:
    if rule not in LEARNING_RATE_RULES:
        raise ValueError(
            f"rule must be one of {LEARNING_RATE_RULES}, got {rule!r}: "
            '"sqrt" for Adam-type optimizers, "linear" or "adascale" for SGD.'
        )


def batch_scale(
    rule: LearningRateRule,
    batch_size: jax.typing.ArrayLike,
    base_batch: float,
    gradient_norm_sq: jax.typing.ArrayLike | None = None,
    gradient_noise_trace: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""The learning-rate factor for a batch :math:`S` times the base
    (:math:`S = \text{batch\_size} / \text{base\_batch}`): a float32 scalar,
    traceable in ``batch_size``.

    * ``"linear"``: :math:`S` (Goyal et al. 2017, for SGD).
    * ``"sqrt"``: :math:`\sqrt{S}`, which keeps the update's noise level for
      Adam-type optimizers (Malladi et al. 2022).
    * ``"none"``: 1.
    * ``"adascale"``: AdaScale's gain
      :math:`\dfrac{\sigma^2 + \mu^2}{\sigma^2 / S + \mu^2}` with
      :math:`\sigma^2 = \operatorname{tr}(\Sigma) / \text{base\_batch}` the
      base batch's gradient variance and :math:`\mu^2 = |G|^2` (Johnson et
      al. 2020): :math:`S` when noise dominates, 1 when the gradient does. The
      estimates are clipped at 0 (an average :math:`|G|^2` can come out
      negative: noise dominates; so does :math:`-\infty`) and the gain
      clamped to :math:`[\min(1, S), \max(1, S)]`; missing, NaN or
      :math:`+\infty` estimates give 1.

    Args:
      rule: one of ``"sqrt"``, ``"linear"``, ``"none"``, ``"adascale"``.
      batch_size: the window's batch, in the unit of ``base_batch``: a real
        scalar ``>= 0`` (traceable).
      base_batch: the batch the base learning rate was tuned for, a positive
        real scalar.
      gradient_norm_sq: for ``"adascale"``, the averaged :math:`|G|^2`: a
        real scalar (shape ``()``; NaN or infinite allowed).
      gradient_noise_trace: for ``"adascale"``, the averaged
        :math:`\operatorname{tr}(\Sigma)`, likewise.

    Returns:
      The factor, a float32 scalar.

    Raises:
      TypeError: naming the argument, for one that is not a real scalar
        (an array of estimates would give a learning rate per element).
      ValueError: naming the argument, for an unknown ``rule``, a
        non-positive ``base_batch``, a negative or non-finite ``batch_size``,
        or a finite number float32 cannot hold.

    Examples:
      >>> import jaxaccum
      >>> float(jaxaccum.batch_scale("sqrt", 256, base_batch=64))
      2.0
      >>> float(jaxaccum.batch_scale("adascale", 256, 64, 1.0, 256.0))
      2.5
    """
    _check_rule(rule)
    _check_base_batch(base_batch)
    _check_batch_size(batch_size)
    for name, estimate in (
        ("gradient_norm_sq", gradient_norm_sq),
        ("gradient_noise_trace", gradient_noise_trace),
    ):
        if estimate is not None:
            _check_reading(
                name,
                estimate,
                hint="Pass the averaged estimate, a scalar (NaN where none yet).",
            )
    return _batch_factor(
        rule, batch_size, base_batch, gradient_norm_sq, gradient_noise_trace
    )


def _check_base_batch(base_batch: Any) -> None:
    check_scalar(
        "base_batch",
        base_batch,
        integer=False,
        low=0,
        open_low=True,
        hint="Pass the batch the learning rate was tuned for.",
    )


def _check_batch_size(batch_size: Any) -> None:
    check_scalar(
        "batch_size",
        batch_size,
        integer=False,
        low=0,
        hint="Pass the window's total, e.g. batch_size=stats.big_batch.",
    )


def _batch_factor(
    rule: str,
    batch_size: jax.typing.ArrayLike,
    base_batch: jax.typing.ArrayLike,
    gradient_norm_sq: jax.typing.ArrayLike | None,
    gradient_noise_trace: jax.typing.ArrayLike | None,
) -> jax.Array:
    """:func:`batch_scale` of checked arguments."""
    scale = _float32(batch_size) / _float32(base_batch)
    if rule == "none":
        return jnp.ones_like(scale)
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return jnp.sqrt(scale)
    return _adascale_gain(scale, gradient_norm_sq, gradient_noise_trace, base_batch)


def _adascale_gain(
    scale: jax.Array,
    gradient_norm_sq: jax.typing.ArrayLike | None,
    gradient_noise_trace: jax.typing.ArrayLike | None,
    base_batch: jax.typing.ArrayLike,
) -> jax.Array:
    nan = jnp.full((), jnp.nan, jnp.float32)
    mean_sq = nan if gradient_norm_sq is None else _float32(gradient_norm_sq)
    trace = nan if gradient_noise_trace is None else _float32(gradient_noise_trace)
    variance = jnp.maximum(trace, 0.0) / _float32(base_batch)
    mean_sq = jnp.maximum(mean_sq, 0.0)
    gain = (variance + mean_sq) / (variance / scale + mean_sq)
    low, high = jnp.minimum(1.0, scale), jnp.maximum(1.0, scale)
    return jnp.where(jnp.isnan(gain), 1.0, jnp.clip(gain, low, high))


class ScaleByBatchState(NamedTuple):
    """The state of :func:`scale_by_batch_learning_rate`.

    Attributes:
      examples_seen: float32, the sum of ``batch_size`` over the updates before.
      examples_seen_error: float32, Kahan's compensation of that sum.
      learning_rate: float32, the learning rate of the last update (for logs).
      noise: for ``"adascale"``, the :class:`jaxaccum.NoiseScaleEMA` state of
        the estimates passed (unused by the other rules).
    """

    examples_seen: jax.Array
    examples_seen_error: jax.Array
    learning_rate: jax.Array
    noise: NoiseScaleState


def scale_by_batch_learning_rate(
    learning_rate: float | Callable[[jax.Array], jax.typing.ArrayLike],
    base_batch: float,
    rule: LearningRateRule = "sqrt",
    *,
    noise_decay: float = 0.95,
    flip_sign: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by a learning rate that follows the batch size.

    Like ``optax.scale_by_learning_rate``, but the learning rate of an update
    is ``learning_rate(examples_seen) * batch_scale(rule, batch_size,
    base_batch)``: the schedule is indexed by the examples seen before the
    update (a sum of ``batch_size``, kept in the state), not by steps, so runs
    with different batch sizes follow the same schedule over the data. Pass the
    window's batch as ``update(..., batch_size=stats.big_batch)``; it is traced,
    so a new batch size recompiles nothing. Put it last in a chain, in place of
    the optimizer's learning rate: ``optax.chain(optax.scale_by_adam(), this)``
    is ``optax.adam`` with this learning rate (the same holds for
    ``optax.adamw``'s pieces, whose weight decay is scaled by it too).

    For ``"adascale"``, also pass the window's estimates,
    ``noise_estimates=stats`` (a :class:`jaxaccum.WindowStats` or
    :class:`jaxaccum.NoiseEstimates`): they are averaged with a
    :class:`jaxaccum.NoiseScaleEMA` of ``noise_decay`` and give the gain (see
    :func:`batch_scale`). AdaScale as published indexes its schedule by the
    sum of gains; here, as for the other rules, it is indexed by examples seen.

    Args:
      learning_rate: a float, or a schedule called with the float32 number of
        examples seen (in the unit of ``batch_size``: examples, or tokens).
      base_batch: the batch ``learning_rate`` was tuned for, positive.
      rule: ``"sqrt"`` (default, for Adam-type optimizers), ``"linear"``,
        ``"none"`` or ``"adascale"`` (for SGD).
      noise_decay: the EMA decay of the estimates, for ``"adascale"``, in
        ``[0, 1)``.
      flip_sign: negate the updates, as ``optax.scale_by_learning_rate``
        does (gradient descent); a bool.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ScaleByBatchState` and whose ``update`` takes ``batch_size=``
      (a real scalar ``>= 0``) and, for ``"adascale"``,
      ``noise_estimates=`` (whose two estimates are real scalars); it raises
      for either otherwise, naming it.

    Raises:
      TypeError: naming the argument, for a number that is not a real
        scalar, or ``flip_sign`` not a bool.
      ValueError: naming the argument, for an unknown ``rule``, a
        non-positive ``base_batch``, a ``noise_decay`` outside ``[0, 1)``,
        or a number float32 cannot hold.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum
      >>> warmup = optax.linear_schedule(0.0, 1e-3, transition_steps=1024)
      >>> opt = optax.chain(
      ...     optax.scale_by_adam(),
      ...     jaxaccum.scale_by_batch_learning_rate(warmup, base_batch=64),
      ... )
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> for batch_size in (256, 256, 1024):  # examples seen: 0, 256, 512
      ...     updates, state = opt.update(
      ...         jnp.ones(2), state, params, batch_size=batch_size
      ...     )
      >>> round(float(state[1].learning_rate), 7)  # 1e-3 * (512 / 1024) * 4
      0.002
    """
    _check_rule(rule)
    _check_base_batch(base_batch)
    noise_decay = check_decay("noise_decay", noise_decay)
    flip_sign = _static_bool("flip_sign", flip_sign)
    schedule = learning_rate if callable(learning_rate) else None
    if schedule is None:
        check_scalar(
            "learning_rate",
            learning_rate,
            integer=False,
            hint="Pass a number or a schedule of the examples seen.",
        )
    ema = NoiseScaleEMA(noise_decay)

    def init_fn(params: optax.Params) -> ScaleByBatchState:
        del params
        zero = jnp.zeros((), jnp.float32)
        return ScaleByBatchState(zero, zero, zero, ema.init())

    def update_fn(
        updates: optax.Updates,
        state: ScaleByBatchState,
        params: optax.Params | None = None,
        *,
        batch_size: jax.typing.ArrayLike | None = None,
        noise_estimates: NoiseEstimatesLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ScaleByBatchState]:
        del params, extra_args
        if batch_size is None:
            raise ValueError(
                "scale_by_batch_learning_rate needs the window's batch: "
                "update(..., batch_size=stats.big_batch)."
            )
        _check_batch_size(batch_size)
        noise = _fold_estimates(ema, state.noise, rule, noise_estimates)
        base_rate = learning_rate if schedule is None else schedule(state.examples_seen)
        factor = _batch_factor(
            rule,
            batch_size,
            base_batch,
            ema.gradient_norm_sq(noise),
            ema.gradient_noise_trace(noise),
        )
        rate = _float32(base_rate) * factor
        signed = -rate if flip_sign else rate
        updates = jax.tree.map(lambda u: jnp.asarray(signed, u.dtype) * u, updates)
        # A traced NaN, infinite or negative batch (checked where concrete)
        # is not counted: examples_seen, which the schedule reads, stays finite.
        batch = _float32(batch_size)
        counted = jnp.where(jnp.isfinite(batch) & (batch >= 0), batch, 0.0)
        seen, error = _add_compensated(
            state.examples_seen, state.examples_seen_error, counted
        )
        return updates, ScaleByBatchState(seen, error, rate, noise)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _fold_estimates(
    ema: NoiseScaleEMA,
    noise: NoiseScaleState,
    rule: str,
    noise_estimates: NoiseEstimatesLike | None,
) -> NoiseScaleState:
    """The EMA with this window's estimates; they are required for adascale."""
    if noise_estimates is None:
        if rule == "adascale":
            raise ValueError(
                'rule="adascale" needs the window\'s estimates: '
                "update(..., batch_size=stats.big_batch, noise_estimates=stats)."
            )
        return noise
    for name in ("gradient_norm_sq", "gradient_noise_trace"):
        _check_reading(
            f"noise_estimates.{name}",
            getattr(noise_estimates, name),
            hint="Pass the window's WindowStats (or NoiseEstimates).",
        )
    estimates = NoiseEstimates(
        _float32(noise_estimates.gradient_norm_sq),
        _float32(noise_estimates.gradient_noise_trace),
        jnp.full((), jnp.nan, jnp.float32),
    )
    return ema.update(noise, estimates)
