r"""The noise-scale controller: :class:`NoiseScaleBatch` sizes each window for
the least predicted time from the measured $B_\text{noise}$ and the step's
cost; its state :class:`NoiseScaleBatchState`, and the two limits of the cost,
:data:`EXAMPLES_ONLY` and :data:`STEPS_ONLY`."""

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
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
    check_reading,
    keep_if,
    static_bool,
    static_count,
    static_positive,
    window_is_valid,
)
from jaxaccum.growth._moments import (
    NoiseMoments,
    NoiseScaleEMA,
    fold_moments,
    read_moments,
)

EXAMPLES_ONLY = 0.0
"""``step_cost`` of a step that costs nothing beyond its examples: the best
window is the smallest that measures."""
STEPS_ONLY = math.inf
"""``step_cost`` of a step that costs more than any window's examples: the best
window is the largest."""
# Fewer windows' spread is no measure of the error: a band from 2 or 3 of them
# is as often too narrow as right.
_MIN_EFFECTIVE_WINDOWS = 4.0
# The averages' effective windows, weight**2 / weight_sq, tend to
# (1 + k) / (1 - k) for windows of B with k = 2**(-B / half_life): the
# controller's _MIN_EFFECTIVE_WINDOWS = 4 needs k >= 3/5, half_life >= 1.36 B.
# Two largest windows give 5.83, reached after 5 windows.
_MIN_HALF_LIFE_WINDOWS = 2.0
# A window of B whose weight 1 - 2**(-B / half_life) float32 keeps above 0.
_MAX_HALF_LIFE_WINDOWS = 2.0**24


class NoiseScaleBatchState(NamedTuple):
    """The state of :class:`NoiseScaleBatch`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: the :class:`ExamplesSeen` (``.total``, the windows'
        ``big_batch`` summed).
      num_microbatches: int32, the next window's number of micro-batches.
      microbatches_seen: int32, the sum of the windows' sizes; with
        ``examples_seen`` it gives a micro-batch's weight in the noise
        scale's unit (``examples_seen.total / microbatches_seen``).
      noise: the :class:`NoiseMoments` of the estimates (read them with
        ``controller.noise_ema``).
    """

    examples_seen: ExamplesSeen
    num_microbatches: jax.Array
    microbatches_seen: jax.Array
    noise: NoiseMoments


@dataclasses.dataclass(frozen=True)
class NoiseScaleBatch(Controller):
    r"""Sizes each window for the least predicted time to the same progress.

    Under McCandlish et al.'s model a run takes $S_\min (1 + B_\text{noise}
    / B)$ steps at batch $B$; with a step costing $t_\text{step} + B\,
    t_\text{example}$ the time is $\propto (1 + B_\text{noise}/B)(c + B)$,
    least at $\sqrt{c\, B_\text{noise}}$, $c$ the ``step_cost``. The
    controller averages the windows' estimates over examples seen
    (:attr:`noise_ema`), starts where $B_\text{noise}$ equal to the largest
    window would put it, and moves (grow-only by default) to the allowed size
    of least predicted time once 4 effective windows are in and the estimate
    $\pm$ ``standard_errors`` standard errors excludes the current one. The
    rule, the defaults and why: the guide "Growing the batch".

    Every quantity with a unit (``step_cost``, ``half_life``, the windows,
    $B_\text{noise}$) is in the unit of ``WindowStats.big_batch``: examples,
    or tokens with ``tokens_per_example``. Every field is kept as a Python
    number (the controller is a static argument of its jitted update).

    Args:
      microbatch_size: examples per micro-batch, a positive int.
      max_microbatches: the largest window, ``>= min_microbatches``.
      min_microbatches: the smallest window, ``>= 2`` (the first with ``kappa``).
      step_cost: $t_\text{step} / t_\text{example}$, ``>= 0``;
        :data:`EXAMPLES_ONLY` (0) or :data:`STEPS_ONLY` (inf) for the limits.
      tokens_per_example: ``None`` (``big_batch`` counts examples), or the
        mean tokens of an example: ``step_cost`` and ``half_life`` count tokens.
      kappa: if given, target $\kappa B_\text{noise}$ instead, nearest in log.
      half_life: of the averages; by default 8 largest windows. At least 2
        largest windows, at most $2^{24}$ smallest ones.
      standard_errors: the evidence band's half-width, ``>= 0``.
      sizes: the allowed window sizes, from ``min_microbatches`` up to
        ``max_microbatches``; by default every int between.
      shrink: allow the window to shrink, to half or less; a bool.

    Raises:
      TypeError: naming the argument: a count not an int, a number not a
        concrete real scalar, ``shrink`` not a bool, ``sizes`` not a sequence.
      ValueError: naming the argument and the fix, for a value out of range.

    Examples:
      >>> import jaxaccum.growth
      >>> controller = jaxaccum.growth.NoiseScaleBatch(
      ...     4, max_microbatches=16, step_cost=16, sizes=(2, 4, 8, 16)
      ... )
      >>> controller.start_microbatches  # sqrt(16 * 64) = 32 examples
      8
      >>> controller.num_microbatches(controller.init())
      8

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training",
      https://arxiv.org/abs/1812.06162
    """

    max_microbatches: int
    _: dataclasses.KW_ONLY
    min_microbatches: int = 2
    step_cost: float = 1024.0
    tokens_per_example: float | None = None
    kappa: float | None = None
    half_life: float | None = None
    standard_errors: float = 1.0
    sizes: Sequence[int] | None = None
    shrink: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        set_field = functools.partial(object.__setattr__, self)
        for name in ("max_microbatches", "min_microbatches"):
            set_field(name, static_count(name, getattr(self, name)))
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
                set_field(name, static_positive(name, getattr(self, name), hint))
        set_field(
            "standard_errors",
            static_scalar(
                "standard_errors", self.standard_errors, integer=False, low=0.0
            ),
        )
        set_field("shrink", static_bool("shrink", self.shrink))
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
    def noise_ema(self) -> NoiseScaleEMA:
        """The average of the estimates the controller keeps (in
        ``state.noise``), with its readers: ``controller.noise_ema.
        standard_error(state.noise)``, say."""
        return NoiseScaleEMA(self.effective_half_life)

    @property
    def start_microbatches(self) -> int:
        r"""The first window: the allowed size of least predicted time if
        $B_\text{noise}$ were the largest window's batch (with ``kappa``,
        ``min_microbatches``)."""
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
        first = jnp.asarray(self.start_microbatches, jnp.int32)
        count = jnp.zeros((), jnp.int32)
        return NoiseScaleBatchState(
            ExamplesSeen.zero(), first, count, self.noise_ema.init()
        )

    def update(
        self, state: NoiseScaleBatchState, stats: WindowTotals
    ) -> NoiseScaleBatchState:
        """Folds in the window's estimates; may move the next window's size.

        Jittable; it reads the scalars ``stats.big_batch``,
        ``stats.gradient_norm_sq`` and ``stats.gradient_noise_trace`` only, and
        runs one compiled program for windows of every size.

        Args:
          state: the state the previous window left (whose
            ``num_microbatches`` the window had).
          stats: the window's :class:`jaxaccum.WindowStats`.

        Returns:
          The state after the window. A window whose ``big_batch`` is not a
          finite number ``>= 0`` leaves it exactly as it was; one with
          non-finite estimates counts its examples and leaves the averages.

        Raises:
          ValueError: for a concrete ``stats.big_batch`` that is NaN, infinite
            or negative; and, counting examples, for one larger than the
            window's examples (it counts tokens: pass ``tokens_per_example``).
        """
        check_big_batch(stats.big_batch)
        _check_window_unit(self, state, stats.big_batch)
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return _noise_scale_update(self, state, *map(as_float32, totals))

    def noise_scale(self, state: NoiseScaleBatchState) -> jax.Array:
        r"""The averaged $B_\text{noise}$ (``noise_ema.noise_scale``), in the
        unit of ``big_batch``; NaN before any window with finite estimates,
        negative or infinite where the averaged $|G|^2$ is not above 0."""
        return self.noise_ema.noise_scale(state.noise)

    def predicted_time(
        self, batch: jax.typing.ArrayLike, noise_scale: jax.typing.ArrayLike
    ) -> jax.Array:
        r"""McCandlish's time to a loss of a window of ``batch`` at a noise
        scale, in units of $S_\min t_\text{example}$:
        $(1 + B_\text{noise} / B)(c + B)$ with $c$ the ``step_cost``;
        $1 + B_\text{noise} / B$ (in units of $S_\min t_\text{step}$) for
        ``STEPS_ONLY``. A negative noise scale counts as infinite (as the
        controller reads it) and gives an infinite time; NaN gives NaN.

        Args:
          batch: the window, in the controller's unit, a positive real scalar.
          noise_scale: $B_\text{noise}$ in the same unit, a real scalar
            (NaN and infinities allowed).

        Returns:
          The predicted time, a float32 scalar (traceable).

        Raises:
          TypeError: for arguments that are not real scalars.
          ValueError: for a ``batch`` that is not a positive finite number,
            or a finite ``noise_scale`` beyond float32's range.

        Examples:
          >>> import jaxaccum.growth
          >>> controller = jaxaccum.growth.NoiseScaleBatch(8, 16, step_cost=64)
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
        check_reading(
            "noise_scale",
            noise_scale,
            hint=f"Pass B_noise in {self.unit}, e.g. controller.noise_scale(state).",
        )
        batch, noise_scale = as_float32(batch), as_float32(noise_scale)
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
            "tokens_per_example), or jaxaccum.growth.STEPS_ONLY for the largest "
            "window.",
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
        static_count(f"sizes[{index}]", size) for index, size in enumerate(sizes)
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
            "(the mean tokens per example) to NoiseScaleBatch, with step_cost "
            "and half_life in tokens; or, if the window ran larger micro-batches, "
            "the microbatch_size it ran."
        )


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
    return state.examples_seen.total / count


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
    r"""The window after ``state``'s: moved only where the evidence puts the
    target, $\phi \pm z\,\mathrm{se}$ apart, wholly on one side of it; to
    the end of that band nearest the current window."""
    reading = read_moments(state.noise)
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
    seen = state.examples_seen.add(big_batch)
    window = state.num_microbatches
    noise = fold_moments(
        state.noise,
        big_batch,
        gradient_norm_sq,
        gradient_noise_trace,
        controller.effective_half_life,
    )
    counted = NoiseScaleBatchState(
        seen, window, state.microbatches_seen + window, noise
    )
    counted = counted._replace(num_microbatches=_next_size(controller, counted))
    return keep_if(window_is_valid(big_batch, seen), counted, state)
