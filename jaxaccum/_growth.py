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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._noise_scale import NoiseEstimates, NoiseScaleEMA, NoiseScaleState
from jaxaccum._options import check_positive_int, check_scalar

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
        check_positive_int("microbatch_size", self.microbatch_size)
        if not self.schedule:
            raise ValueError("schedule is empty; pass e.g. {0: 1, 100_000: 2}.")
        keys = [key for key, _ in self.schedule]
        for key, value in self.schedule:
            if isinstance(key, bool) or not isinstance(key, int | np.integer):
                raise TypeError(
                    f"schedule keys are examples seen, ints; got {key!r} of type "
                    f"{type(key).__name__}."
                )
            check_positive_int(f"schedule[{key}]", value, "It counts micro-batches.")
        if keys != sorted(set(keys)):
            raise ValueError(f"schedule keys must increase, got {keys}.")
        if keys[0] != 0:
            raise ValueError(
                f"schedule must start at 0 examples seen, its first key is "
                f"{keys[0]}; add e.g. 0: 1 for the first windows."
            )

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
        ``{0: 1, 100_000: 2, 400_000: 8}``; keys ints starting at 0, values
        positive ints.

    Returns:
      A :class:`BatchRamp` (``init``, ``update``, ``num_microbatches``).

    Raises:
      ValueError: for a schedule not starting at 0 or with a non-positive
        value, or a non-positive ``microbatch_size``.

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
    return BatchRamp(microbatch_size, tuple(sorted(schedule.items())))


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

    Attributes:
      microbatch_size: examples per micro-batch.
      max_microbatches: the largest window.
      min_microbatches: the smallest window.
      step_cost: a step's fixed cost in examples, ``t_step / t_example``.
      kappa: if set, the target is $\\kappa B_\\text{noise}$ instead
        (step_cost unused).
      half_life: of the moving averages, in the unit of ``big_batch``.
      standard_errors: how far (in standard errors of the estimate) the
        evidence must put the target from the current window to move it.
      sizes: the allowed window sizes, ascending.
      shrink: whether the window may shrink (with 2x hysteresis).
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

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "max_microbatches", "min_microbatches"):
            check_positive_int(name, getattr(self, name))
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
        if self.step_cost != STEPS_ONLY:
            check_scalar(
                "step_cost",
                self.step_cost,
                integer=False,
                low=0.0,
                hint="(examples; jaxaccum.STEPS_ONLY for the largest window)",
            )
        if self.kappa is not None:
            check_scalar("kappa", self.kappa, integer=False, low=0.0, open_low=True)
        if self.half_life is not None:
            check_scalar(
                "half_life", self.half_life, integer=False, low=0.0, open_low=True
            )
        check_scalar("standard_errors", self.standard_errors, integer=False, low=0.0)
        for size in self.possible_num_microbatches:
            check_positive_int("sizes", size)
        if self.possible_num_microbatches[0] != self.min_microbatches or not (
            self.possible_num_microbatches[-1] <= self.max_microbatches
        ):
            raise ValueError(
                f"sizes must start at min_microbatches ({self.min_microbatches}) "
                f"and end at most at max_microbatches ({self.max_microbatches}), "
                f"got {self.sizes}."
            )

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size it can ask for, ascending: ``sizes``, by default
        every int from ``min_microbatches`` to ``max_microbatches``."""
        if self.sizes is not None:
            return tuple(sorted(set(self.sizes)))
        return tuple(range(self.min_microbatches, self.max_microbatches + 1))

    @property
    def effective_half_life(self) -> float:
        """``half_life``, by default 8 of the largest windows' examples."""
        if self.half_life is not None:
            return float(self.half_life)
        return 8.0 * self.max_microbatches * self.microbatch_size

    @property
    def start_microbatches(self) -> int:
        """The first window: the allowed size of least predicted time if
        $B_\\text{noise}$ were the largest window's batch (with ``kappa``,
        ``min_microbatches``); see :func:`noise_scale_batch`."""
        if self.kappa is not None:
            return self.min_microbatches
        sizes = self.possible_num_microbatches
        # On the host (init may be traced): sizes and costs are static.
        batches = np.asarray(sizes, np.float64) * self.microbatch_size
        steps = 1.0 / batches[-1] + 1.0 / batches
        if self.step_cost == EXAMPLES_ONLY:
            return sizes[0]
        if self.step_cost == STEPS_ONLY:
            return sizes[-1]
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
            or negative.
        """
        _check_big_batch(stats.big_batch)
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return _noise_scale_update(self, state, *map(_float32, totals))

    def num_microbatches(self, state: NoiseScaleBatchState) -> int:
        """The next window's number of micro-batches, a Python int (blocks)."""
        return int(state.num_microbatches)

    def effective_batch_size(self, state: NoiseScaleBatchState) -> int:
        """The next window's ``num_microbatches * microbatch_size``."""
        return self.num_microbatches(state) * self.microbatch_size

    def noise_scale(self, state: NoiseScaleBatchState) -> jax.Array:
        """The averaged $B_\\text{noise}$, in the unit of ``big_batch``; NaN
        before any window with finite estimates."""
        moments = state.noise
        return moments.trace / moments.norm_sq

    def predicted_time(self, batch: jax.Array, noise_scale: jax.Array) -> jax.Array:
        """McCandlish's time to a loss, in units of ``S_min t_example``, of a
        window of ``batch`` examples at a noise scale:
        $(1 + B_\\text{noise} / B)(c + B)$ with $c$ the ``step_cost``
        ($1 + B_\\text{noise} / B$ for ``STEPS_ONLY``)."""
        return _predicted_time(self, batch, 1.0 / noise_scale)


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


def _predicted_time(
    controller: NoiseScaleBatch, batch: jax.Array, phi: jax.Array
) -> jax.Array:
    """``(1 + B_noise / B)(c + B)`` times ``phi`` (a constant factor), which
    stays finite for ``phi <= 0`` (an infinite noise scale)."""
    phi = jnp.maximum(phi, 0.0)
    steps = (phi * batch + 1.0) / batch
    if controller.step_cost == STEPS_ONLY:
        return steps
    return steps * (controller.step_cost + batch)


def _microbatch_weight(state: NoiseScaleBatchState) -> jax.Array:
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
        score = _predicted_time(controller, batches, phi)
    return sizes[jnp.argmin(score)]


def _next_size(controller: NoiseScaleBatch, state: NoiseScaleBatchState) -> jax.Array:
    """The window after ``state``'s: moved only where the evidence puts the
    target, $\\phi \\pm z\\,\\mathrm{se}$ apart, wholly on one side of it; to
    the end of that band nearest the current window."""
    reading = _read_moments(state.noise)
    band = controller.standard_errors * reading.standard_error
    weight = _microbatch_weight(state)
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

    The estimate. The $|G|^2$ and $\operatorname{tr}(\Sigma)$ estimates are
    averaged over examples seen, not windows: a window of $B$ examples
    decays the averages by $2^{-B/h}$ for a ``half_life`` $h$, so runs with
    different windows average over the same stretch of training and read the
    same $B_\text{noise}$ at the same examples seen.

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
    * ``half_life``: 8 largest windows' examples; short enough to follow a
      noise scale that grows as the loss falls, long enough for about 23
      windows of the largest size in the average.
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
      step_cost: $t_\text{step} / t_\text{example}$, in the unit of
        ``big_batch``: ``>= 0``, or ``math.inf``.
      kappa: if given, target $\kappa B_\text{noise}$ (McCandlish's
        critical batch for $\kappa = 1$) instead, nearest in log;
        ``step_cost`` is then unused.
      half_life: of the averages, in examples (in the unit of ``big_batch``:
        pass it for tokens); positive.
      standard_errors: the band's half-width, in standard errors; ``>= 0``.
      sizes: the allowed window sizes (micro-batches), from
        ``min_microbatches`` up to ``max_microbatches``.
      shrink: allow the window to shrink, with 2x hysteresis.

    Returns:
      A :class:`NoiseScaleBatch` (``init``, ``update``, ``num_microbatches``,
      ``noise_scale``).

    Raises:
      ValueError: naming the argument, for ``min_microbatches < 2``,
        ``max_microbatches < min_microbatches``, a non-positive count,
        ``kappa`` or ``half_life``, a negative ``step_cost`` or
        ``standard_errors``, or ``sizes`` outside the range.

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
        None if sizes is None else tuple(sizes),
        shrink,
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
      repeats: calls per size; the least time counts, the median's distance
        from it is the timing's scatter.

    Returns:
      A :class:`StepCost`.

    Raises:
      ValueError: for sizes not increasing; when the larger window was not
        slower (timing noise: choose sizes further apart); when
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
    check_positive_int("microbatch_size", microbatch_size)
    check_positive_int("repeats", repeats)
    small, large = num_microbatches
    check_positive_int("num_microbatches[0]", small)
    check_positive_int("num_microbatches[1]", large)
    if not small < large:
        raise ValueError(
            f"num_microbatches must be two increasing sizes, got {num_microbatches}."
        )
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


OptimizerFamily = Literal["sgd", "adam"]
"""How :func:`ramp_from_schedule` trades the learning rate for the batch."""


class ScheduleRamp(NamedTuple):
    """A learning-rate decay turned into a batch ramp.

    Attributes:
      ramp: the :class:`BatchRamp`, by examples seen.
      learning_rate: the learning rate that goes with it, a schedule of
        examples seen: pass it to ``scale_by_batch_learning_rate(...,
        rule="none")`` (it already holds the batch's factor).
    """

    ramp: BatchRamp
    learning_rate: Callable[[jax.Array], jax.Array]


def ramp_from_schedule(
    schedule: Callable[[Any], Any],
    microbatch_size: int,
    num_microbatches: int,
    max_microbatches: int,
    total_examples: int,
    *,
    optimizer: OptimizerFamily = "adam",
    points: int = 256,
) -> ScheduleRamp:
    """Turns a learning-rate decay into a batch ramp and its learning rate.

    Where ``schedule`` (a learning rate by examples seen, tuned for windows of
    ``num_microbatches``) has fallen by a factor $\\alpha < 1$ from its peak
    so far, the window is multiplied by $1/\\alpha$ (rounded down, clamped at
    ``max_microbatches``) and the learning rate becomes
    ``schedule(e) * (N / num_microbatches) ** p``: for ``"sgd"`` $p = 1$, so
    the rate stays at its peak while the batch grows (Smith et al. 2018); for
    ``"adam"`` $p = 1/2$, Seesaw's rule (Meterez et al. 2025): where the
    schedule would halve the rate, double the batch and multiply the rate by
    $1/\\sqrt{2}$. Once the window is at its maximum the rate decays as the
    schedule does. A warm-up (the schedule rising) is kept as it is.

    The trade holds where a bigger batch costs no extra examples, well below
    the noise scale; beyond it the ramp spends more examples than the decay at
    the batch it was tuned for. Judge it against that decay at a fixed batch:
    on this repository's benchmarks (``benchmarks/growth.py cost``) it lost to
    it, saving time only against the decay at its smallest window where steps
    are expensive.

    Args:
      schedule: the learning rate by examples seen (``optax`` schedules work
        when given examples seen as their count).
      microbatch_size: examples per micro-batch.
      num_microbatches: the window ``schedule`` was tuned for.
      max_microbatches: the largest window.
      total_examples: the run's length; the schedule is read at ``points``
        even steps of it.
      optimizer: ``"adam"`` (Seesaw) or ``"sgd"`` (Smith et al.).
      points: where the ramp may change.

    Returns:
      A :class:`ScheduleRamp` ``(ramp, learning_rate)``.

    Examples:
      >>> import optax, jaxaccum
      >>> decay = optax.piecewise_constant_schedule(1.0, {1000: 0.5, 2000: 0.5})
      >>> built = jaxaccum.ramp_from_schedule(decay, 8, 2, 16, 3000, points=3)
      >>> built.ramp.schedule
      ((0, 2), (1000, 4), (2000, 8))
      >>> round(float(built.learning_rate(2500.0)), 4)  # 0.25 * sqrt(4)
      0.5

    References:
      Smith et al., 2018, "Don't Decay the Learning Rate, Increase the Batch
      Size", https://arxiv.org/abs/1711.00489. Meterez et al., 2025,
      "Seesaw: Accelerating Training by Balancing Learning Rate and Batch
      Size Scheduling", https://arxiv.org/abs/2510.14717
    """
    for name, value in (
        ("microbatch_size", microbatch_size),
        ("num_microbatches", num_microbatches),
        ("max_microbatches", max_microbatches),
        ("total_examples", total_examples),
        ("points", points),
    ):
        check_positive_int(name, value)
    if optimizer not in typing.get_args(OptimizerFamily):
        raise ValueError(f'optimizer must be "adam" or "sgd", got {optimizer!r}.')
    power = 1.0 if optimizer == "sgd" else 0.5
    sizes: dict[int, int] = {}
    peak = 0.0
    for point in range(points):
        examples = total_examples * point // points
        rate = float(schedule(examples))
        peak = max(peak, rate)
        factor = peak / rate if rate > 0 else (math.inf if peak > 0 else 1.0)
        size = min(max_microbatches, math.floor(num_microbatches * factor + 1e-6))
        size = max(size, num_microbatches)
        if not sizes or size != list(sizes.values())[-1]:
            sizes[examples] = size
    ramp = batch_ramp(microbatch_size, sizes)
    keys = jnp.asarray(list(sizes), jnp.float32)
    factors = (
        jnp.asarray(list(sizes.values()), jnp.float32) / num_microbatches
    ) ** power

    def learning_rate(examples_seen: jax.Array) -> jax.Array:
        index = jnp.searchsorted(keys, examples_seen, side="right") - 1
        return _float32(schedule(examples_seen)) * factors[index]

    return ScheduleRamp(ramp, learning_rate)


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
      negative: noise dominates) and the gain clamped to
      :math:`[\min(1, S), \max(1, S)]`; missing or NaN estimates give 1.

    Args:
      rule: one of ``"sqrt"``, ``"linear"``, ``"none"``, ``"adascale"``.
      batch_size: the window's batch, in the unit of ``base_batch``.
      base_batch: the batch the base learning rate was tuned for.
      gradient_norm_sq: for ``"adascale"``, the averaged :math:`|G|^2`.
      gradient_noise_trace: for ``"adascale"``, the averaged
        :math:`\operatorname{tr}(\Sigma)`.

    Returns:
      The factor, a float32 scalar.

    Examples:
      >>> import jaxaccum
      >>> float(jaxaccum.batch_scale("sqrt", 256, base_batch=64))
      2.0
      >>> float(jaxaccum.batch_scale("adascale", 256, 64, 1.0, 256.0))
      2.5
    """
    _check_rule(rule)
    check_scalar("base_batch", base_batch, integer=False, low=0, open_low=True)
    check_scalar(
        "batch_size",
        batch_size,
        integer=False,
        low=0,
        hint="Pass the window's total, e.g. batch_size=stats.big_batch.",
    )
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
    base_batch: float,
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
      noise_decay: the EMA decay of the estimates, for ``"adascale"``.
      flip_sign: negate the updates, as ``optax.scale_by_learning_rate``
        does (gradient descent).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ScaleByBatchState` and whose ``update`` takes ``batch_size=``
      (and ``noise_estimates=`` for ``"adascale"``).

    Raises:
      ValueError: for an unknown ``rule``, or a non-positive ``base_batch``.

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
    check_scalar("base_batch", base_batch, integer=False, low=0, open_low=True)
    check_scalar("noise_decay", noise_decay, integer=False, low=0)
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
        noise = _fold_estimates(ema, state.noise, rule, noise_estimates)
        base_rate = learning_rate if schedule is None else schedule(state.examples_seen)
        factor = batch_scale(
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
    estimates = NoiseEstimates(
        _float32(noise_estimates.gradient_norm_sq),
        _float32(noise_estimates.gradient_noise_trace),
        jnp.full((), jnp.nan, jnp.float32),
    )
    return ema.update(noise, estimates)
