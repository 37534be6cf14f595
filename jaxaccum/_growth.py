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
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._noise_scale import NoiseEstimates, NoiseScaleEMA, NoiseScaleState
from jaxaccum._options import check_positive_int

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
    rounding dropped so far (the exact sum is ``total - error``)."""
    corrected = value - error
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


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
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(
                    f"schedule[{key}] must be a positive int number of "
                    f"micro-batches, got {value!r} of type {type(value).__name__}."
                )
            if value < 1:
                raise ValueError(
                    f"schedule[{key}] must be a positive number of micro-batches, "
                    f"got {value}."
                )
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
          The state after the window.
        """
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
    return BatchRampState(seen, error, values[index])


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


class NoiseScaleBatchState(NamedTuple):
    """The state of :class:`NoiseScaleBatch`: a pytree, checkpointable as it is.

    Attributes:
      examples_seen: float32, the sum of the windows' ``big_batch`` so far.
      examples_seen_error: float32, Kahan's compensation of that sum.
      num_microbatches: int32, the next window's number of micro-batches.
      microbatches_seen: int32, the sum of the windows' sizes; with
        ``examples_seen`` it gives a micro-batch's weight in the noise
        scale's unit (``examples_seen / microbatches_seen``).
      windows_since_change: int32, windows since the size last changed (or
        since the start).
      noise: the :class:`jaxaccum.NoiseScaleEMA` state of the estimates.
    """

    examples_seen: jax.Array
    examples_seen_error: jax.Array
    num_microbatches: jax.Array
    microbatches_seen: jax.Array
    windows_since_change: jax.Array
    noise: NoiseScaleState


@dataclasses.dataclass(frozen=True)
class NoiseScaleBatch:
    """Grows the window towards the measured noise scale; see
    :func:`noise_scale_batch` for the rule and the defaults.

    Attributes:
      microbatch_size: examples per micro-batch.
      max_microbatches: the largest window.
      min_microbatches: the first (and smallest) window.
      kappa: the target window is ``kappa * B_noise``.
      decay: of the EMAs of ``|G|^2`` and ``tr(Sigma)``.
      warmup_windows: windows with finite estimates before the first change.
      min_windows_between_changes: windows from one change to the next.
    """

    microbatch_size: int
    max_microbatches: int
    min_microbatches: int = 2
    kappa: float = 1.0
    decay: float = 0.98
    warmup_windows: int = 50
    min_windows_between_changes: int = 50

    def __post_init__(self) -> None:
        for name in (
            "microbatch_size",
            "max_microbatches",
            "min_microbatches",
            "warmup_windows",
            "min_windows_between_changes",
        ):
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
        if not (math.isfinite(self.kappa) and self.kappa > 0):
            raise ValueError(f"kappa must be a positive number, got {self.kappa!r}.")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}.")

    @property
    def possible_num_microbatches(self) -> tuple[int, ...]:
        """Every window size it can ask for, ascending: ``min_microbatches``
        doubled while below ``max_microbatches``, then ``max_microbatches``."""
        sizes = [self.min_microbatches]
        while sizes[-1] < self.max_microbatches:
            sizes.append(min(2 * sizes[-1], self.max_microbatches))
        return tuple(sizes)

    def init(self) -> NoiseScaleBatchState:
        """The state before any window: ``min_microbatches`` next."""
        zero = jnp.zeros((), jnp.float32)
        count = jnp.zeros((), jnp.int32)
        first = jnp.asarray(self.min_microbatches, jnp.int32)
        noise = NoiseScaleEMA(self.decay).init()
        return NoiseScaleBatchState(zero, zero, first, count, count, noise)

    def update(
        self, state: NoiseScaleBatchState, stats: WindowTotals
    ) -> NoiseScaleBatchState:
        """Folds in the window's estimates; may double the next window.

        Jittable. It reads the scalars ``stats.big_batch``,
        ``stats.gradient_norm_sq`` and ``stats.gradient_noise_trace`` only, and
        runs one compiled program for windows of every size.

        Args:
          state: the state the previous window left (whose
            ``num_microbatches`` the window had).
          stats: the window's :class:`jaxaccum.WindowStats`.

        Returns:
          The state after the window.
        """
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return _noise_scale_update(self, state, *map(_float32, totals))

    def num_microbatches(self, state: NoiseScaleBatchState) -> int:
        """The next window's number of micro-batches, a Python int (blocks)."""
        return int(state.num_microbatches)

    def effective_batch_size(self, state: NoiseScaleBatchState) -> int:
        """The next window's ``num_microbatches * microbatch_size``."""
        return self.num_microbatches(state) * self.microbatch_size

    def noise_scale(self, state: NoiseScaleBatchState) -> jax.Array:
        """The averaged ``B_noise``, in the unit of ``big_batch``; NaN before
        any window with finite estimates."""
        return NoiseScaleEMA(self.decay).noise_scale(state.noise)


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
    microbatches_seen = state.microbatches_seen + window
    estimates = NoiseEstimates(
        gradient_norm_sq, gradient_noise_trace, gradient_noise_trace / gradient_norm_sq
    )
    noise = NoiseScaleEMA(controller.decay).update(state.noise, estimates)
    since_change = state.windows_since_change + 1
    microbatch_weight = seen / microbatches_seen.astype(jnp.float32)
    # kappa B_noise >= 2 N b, without dividing: the two EMAs share their bias
    # correction, and a |G|^2 average <= 0 (signal lost in the noise) then
    # asks to grow as an infinite noise scale would. NaN compares False.
    trace, norm_sq = noise.gradient_noise_trace, noise.gradient_norm_sq
    doubling_pays = (trace > 0) & (
        controller.kappa * trace >= 2 * window * microbatch_weight * norm_sq
    )
    grow = (
        doubling_pays
        & (noise.num_windows >= controller.warmup_windows)
        & (since_change >= controller.min_windows_between_changes)
        & (window < controller.max_microbatches)
    )
    return NoiseScaleBatchState(
        examples_seen=seen,
        examples_seen_error=error,
        num_microbatches=jnp.where(
            grow, jnp.minimum(2 * window, controller.max_microbatches), window
        ),
        microbatches_seen=microbatches_seen,
        windows_since_change=jnp.where(grow, 0, since_change),
        noise=noise,
    )


def noise_scale_batch(
    microbatch_size: int,
    max_microbatches: int,
    *,
    min_microbatches: int = 2,
    kappa: float = 1.0,
    decay: float = 0.98,
    warmup_windows: int = 50,
    min_windows_between_changes: int = 50,
) -> NoiseScaleBatch:
    """Grows the window while the gradient noise scale says a bigger one pays.

    Each window's unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` (see
    :class:`jaxaccum.WindowStats`) go into exponential moving averages, and
    their ratio is the noise scale ``B_noise``. The window of ``N`` micro-batches
    of weight ``b`` doubles (clamped at ``max_microbatches``) when
    ``kappa * B_noise >= 2 N b``, so it settles at the largest size in
    ``(kappa B_noise / 2, kappa B_noise]``, within 2x of the target. It never
    shrinks: the noise scale grows as the loss falls, and a shrink would follow
    noise. ``b``, in the unit of the noise scale (examples, or tokens with
    ``reduction="weighted"``), is the run's ``examples_seen`` over the
    micro-batches it came in, so it also counts data-parallel devices.

    The defaults, and why:

    * ``kappa=1``: the critical batch ``B_crit ~ B_noise`` of McCandlish et al.
      (2018), where doubling the batch stops halving the steps (it still saves
      ``1 / (1 + B_noise / B)`` of them) and starts costing compute.
    * ``min_microbatches=2``: one micro-batch gives one batch size and no
      estimate (NaN), so the smallest window that measures is 2.
    * ``decay=0.98``: an average over about 1 / (1 - decay) = 50 windows
      (variance (1 - decay) / (1 + decay) ~ 1/99 of one window's). One window's
      ``|G|^2`` estimate is noisy (often negative while ``B << B_noise``), and
      a grow-only rule ratchets up on the average's high fluctuations. On
      the 6-parameter population of ``tests/test_growth.py`` (``B_noise``
      170.5 examples, micro-batches of 8), ``decay=0.95`` doubled past the
      target to 256 examples in 10 of 10 runs of 600 windows; 0.98 (0.63x the
      standard deviation) in 2 of 6 runs of 1000, the others holding at 128.
      gpt-neox uses 0.99.
    * ``warmup_windows=50`` and ``min_windows_between_changes=50``: one EMA
      time constant, so each decision rests on ~50 windows and at least that
      many pass between doublings: at most 2x per 50 windows (2 to 64
      micro-batches in 250 windows), and no single noisy estimate can move
      the size.
    * Windows with a NaN or infinite estimate (one non-empty micro-batch, a
      non-finite gradient) are left out of the averages, as in
      :class:`jaxaccum.NoiseScaleEMA`.

    Args:
      microbatch_size: examples per micro-batch, a positive int.
      max_microbatches: the largest window, ``>= min_microbatches``.
      min_microbatches: the first window, ``>= 2``.
      kappa: the target window is ``kappa * B_noise``; positive.
      decay: of the moving averages, in ``[0, 1)``.
      warmup_windows: windows with finite estimates before the first change.
      min_windows_between_changes: windows from one change to the next.

    Returns:
      A :class:`NoiseScaleBatch` (``init``, ``update``, ``num_microbatches``,
      ``noise_scale``).

    Raises:
      ValueError: naming the argument, for ``min_microbatches < 2``,
        ``max_microbatches < min_microbatches``, a non-positive count or
        ``kappa``, or ``decay`` outside ``[0, 1)``.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> controller = jaxaccum.noise_scale_batch(
      ...     4, max_microbatches=16, warmup_windows=10, min_windows_between_changes=10
      ... )
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
      >>> sizes[0], sizes == sorted(sizes), controller.possible_num_microbatches
      (2, True, (2, 4, 8, 16))

    References:
      McCandlish et al., 2018, "An Empirical Model of Large-Batch Training",
      https://arxiv.org/abs/1812.06162
    """
    return NoiseScaleBatch(
        microbatch_size,
        max_microbatches,
        min_microbatches,
        kappa,
        decay,
        warmup_windows,
        min_windows_between_changes,
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
    """The learning-rate factor for a batch ``S = batch_size / base_batch``
    times the base: a float32 scalar, traceable in ``batch_size``.

    * ``"linear"``: ``S`` (Goyal et al. 2017, for SGD).
    * ``"sqrt"``: ``sqrt(S)``, which keeps the update's noise level for
      Adam-type optimizers (Malladi et al. 2022).
    * ``"none"``: 1.
    * ``"adascale"``: AdaScale's gain ``(sigma^2 + mu^2) / (sigma^2 / S +
      mu^2)`` with ``sigma^2 = tr(Sigma) / base_batch`` the base batch's
      gradient variance and ``mu^2 = |G|^2`` (Johnson et al. 2020): ``S`` when
      noise dominates, 1 when the gradient does. The estimates are clipped at
      0 (an average ``|G|^2`` can come out negative: noise dominates) and the
      gain clamped to ``[min(1, S), max(1, S)]``; missing or NaN estimates
      give 1.

    Args:
      rule: one of ``"sqrt"``, ``"linear"``, ``"none"``, ``"adascale"``.
      batch_size: the window's batch, in the unit of ``base_batch``.
      base_batch: the batch the base learning rate was tuned for.
      gradient_norm_sq: for ``"adascale"``, the averaged ``|G|^2``.
      gradient_noise_trace: for ``"adascale"``, the averaged ``tr(Sigma)``.

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
    if not (math.isfinite(base_batch) and base_batch > 0):
        raise ValueError(f"base_batch must be a positive number, got {base_batch!r}.")
    schedule = learning_rate if callable(learning_rate) else None
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
        seen, error = _add_compensated(
            state.examples_seen, state.examples_seen_error, _float32(batch_size)
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
