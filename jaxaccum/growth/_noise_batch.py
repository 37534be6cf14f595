r"""The noise-scale controller: :class:`NoiseScaleBatch` sizes each window for
the least predicted time from the measured $B_\text{noise}$ and the step's
cost (its state and the cost's limits: ``_noise_batch_state``)."""

import dataclasses
import functools
from collections.abc import Sequence

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
    static_bool,
    static_count,
    static_positive,
)
from jaxaccum.growth._moments import (
    NoiseScaleEMA,
)
from jaxaccum.growth._noise_batch_checks import (
    check_half_life,
    check_size_range,
    check_window_unit,
    static_sizes,
    static_step_cost,
)
from jaxaccum.growth._noise_batch_state import (
    EXAMPLES_ONLY,
    STEPS_ONLY,
    NoiseScaleBatchState,
)
from jaxaccum.growth._noise_batch_update import noise_scale_update

"""``step_cost`` of a step that costs nothing beyond its examples: the best
window is the smallest that measures."""
"""``step_cost`` of a step that costs more than any window's examples: the best
window is the largest."""


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
        set_field("step_cost", static_step_cost(self.step_cost))
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
            set_field("sizes", static_sizes(self.sizes))
        check_size_range(self)
        check_half_life(self)

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
        check_window_unit(self, state, stats.big_batch)
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return noise_scale_update(self, state, *map(as_float32, totals))

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
