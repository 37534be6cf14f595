"""The learning rate that follows the batch: the rules
(:data:`LearningRateRule`), their factor (:func:`batch_scale`), and the Optax
transformation :func:`scale_by_batch_learning_rate` (state
:class:`ScaleByBatchState`), its schedule indexed by examples seen."""

import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum._checks import check_scalar
from jaxaccum._types import PyTree
from jaxaccum.growth._base import (
    ExamplesSeen,
    NoiseEstimatesLike,
    as_float32,
    check_reading,
    static_bool,
    static_positive,
)
from jaxaccum.growth._moments import NoiseMoments, NoiseScaleEMA

LearningRateRule = Literal["sqrt", "linear", "none", "adascale"]
"""How the learning rate follows the batch: ``"sqrt"`` (Adam-type optimizers),
``"linear"`` (SGD), ``"none"``, or ``"adascale"`` (the AdaScale gain from the
measured noise, for SGD); see :func:`batch_scale`."""
LEARNING_RATE_RULES: tuple[str, ...] = typing.get_args(LearningRateRule)
# The adascale average's half-life, in base batches, when none is given: the
# span of a per-window decay of 0.95 (13.5 windows) at windows of about 5 base
# batches, long enough for a steady gain, short enough to follow the noise.
_DEFAULT_NOISE_HALF_LIFE = 64.0


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
      >>> import jaxaccum.growth
      >>> float(jaxaccum.growth.batch_scale("sqrt", 256, base_batch=64))
      2.0
      >>> float(jaxaccum.growth.batch_scale("adascale", 256, 64, 1.0, 256.0))
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
            check_reading(
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
    scale = as_float32(batch_size) / as_float32(base_batch)
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
    mean_sq = nan if gradient_norm_sq is None else as_float32(gradient_norm_sq)
    trace = nan if gradient_noise_trace is None else as_float32(gradient_noise_trace)
    variance = jnp.maximum(trace, 0.0) / as_float32(base_batch)
    mean_sq = jnp.maximum(mean_sq, 0.0)
    gain = (variance + mean_sq) / (variance / scale + mean_sq)
    low, high = jnp.minimum(1.0, scale), jnp.maximum(1.0, scale)
    return jnp.where(jnp.isnan(gain), 1.0, jnp.clip(gain, low, high))


class ScaleByBatchState(NamedTuple):
    """The state of :func:`scale_by_batch_learning_rate`.

    Attributes:
      examples_seen: the :class:`ExamplesSeen` before this update
        (``.total``, the sum of ``batch_size`` over the updates before): what
        the schedule reads.
      learning_rate: float32, the learning rate of the last update (for logs).
      noise: for ``"adascale"``, the :class:`NoiseMoments` of the estimates
        passed (unused by the other rules).
    """

    examples_seen: ExamplesSeen
    learning_rate: jax.Array
    noise: NoiseMoments


class _Window(NamedTuple):
    """A window's totals for the average: its batch and its two estimates."""

    big_batch: jax.Array
    gradient_norm_sq: jax.Array
    gradient_noise_trace: jax.Array


def scale_by_batch_learning_rate(
    learning_rate: float | Callable[[jax.Array], jax.typing.ArrayLike],
    base_batch: float,
    rule: LearningRateRule = "sqrt",
    *,
    noise_half_life: float | None = None,
    flip_sign: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Scales updates by a learning rate that follows the batch size.

    Like ``optax.scale_by_learning_rate``, but the rate of an update is
    ``learning_rate(examples_seen) * batch_scale(rule, batch_size,
    base_batch)``, the schedule indexed by the examples seen before the
    update (a sum of ``batch_size``), not by steps. Pass the window's batch,
    ``update(..., batch_size=stats.big_batch)`` (traced: a new size
    recompiles nothing); put it last in a chain, in place of the optimizer's
    learning rate. For ``"adascale"`` also pass ``noise_estimates=stats``:
    they are averaged per example (a :class:`NoiseScaleEMA`, each window
    weighted by its ``batch_size``) and give the gain (:func:`batch_scale`).

    Args:
      learning_rate: a float, or a schedule called with the float32 number of
        examples seen (in the unit of ``batch_size``: examples, or tokens).
      base_batch: the batch ``learning_rate`` was tuned for, positive.
      rule: ``"sqrt"`` (default, for Adam-type optimizers), ``"linear"``,
        ``"none"`` or ``"adascale"`` (for SGD).
      noise_half_life: for ``"adascale"``, the half-life of the estimates'
        average, in the unit of ``batch_size``; positive. By default 64 base
        batches (``64 * base_batch``).
      flip_sign: negate the updates (gradient descent), a bool.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (state
      :class:`ScaleByBatchState`) whose ``update`` takes ``batch_size=`` (a
      real scalar ``>= 0``) and, for ``"adascale"``, ``noise_estimates=``.

    Raises:
      TypeError: naming the argument, for a number that is not a real
        scalar, or ``flip_sign`` not a bool.
      ValueError: naming the argument, for an unknown ``rule``, a
        non-positive ``base_batch`` or ``noise_half_life``, or a number
        float32 cannot hold.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum.growth
      >>> warmup = optax.linear_schedule(0.0, 1e-3, transition_steps=1024)
      >>> opt = optax.chain(
      ...     optax.scale_by_adam(),
      ...     jaxaccum.growth.scale_by_batch_learning_rate(warmup, base_batch=64),
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
    flip_sign = static_bool("flip_sign", flip_sign)
    if noise_half_life is None:
        noise_half_life = _DEFAULT_NOISE_HALF_LIFE * float(base_batch)
    else:
        noise_half_life = static_positive(
            "noise_half_life",
            noise_half_life,
            hint="In the unit of batch_size (examples, or tokens).",
        )
    ema = NoiseScaleEMA(noise_half_life)
    schedule = learning_rate if callable(learning_rate) else None
    if schedule is None:
        check_scalar(
            "learning_rate",
            learning_rate,
            integer=False,
            hint="Pass a number or a schedule of the examples seen.",
        )

    def init_fn(params: optax.Params) -> ScaleByBatchState:
        del params
        zero = jnp.zeros((), jnp.float32)
        return ScaleByBatchState(ExamplesSeen.zero(), zero, ema.init())

    def update_fn(
        updates: optax.Updates,
        state: ScaleByBatchState,
        params: optax.Params | None = None,
        *,
        batch_size: jax.typing.ArrayLike | None = None,
        noise_estimates: NoiseEstimatesLike | None = None,
        **extra_args: PyTree,
    ) -> tuple[optax.Updates, ScaleByBatchState]:
        del params, extra_args
        if batch_size is None:
            raise ValueError(
                "scale_by_batch_learning_rate needs the window's batch: "
                "update(..., batch_size=stats.big_batch)."
            )
        _check_batch_size(batch_size)
        batch = as_float32(batch_size)
        noise = _fold_estimates(ema, state.noise, rule, noise_estimates, batch)
        seen = state.examples_seen
        base_rate = learning_rate if schedule is None else schedule(seen.total)
        factor = _batch_factor(
            rule,
            batch,
            base_batch,
            ema.gradient_norm_sq(noise),
            ema.gradient_noise_trace(noise),
        )
        rate = as_float32(base_rate) * factor
        signed = -rate if flip_sign else rate
        updates = jax.tree.map(lambda u: jnp.asarray(signed, u.dtype) * u, updates)
        # A traced NaN, infinite or negative batch (checked where concrete)
        # is not counted: examples_seen, which the schedule reads, stays finite.
        counted = jnp.where(jnp.isfinite(batch) & (batch >= 0), batch, 0.0)
        return updates, ScaleByBatchState(seen.add(counted), rate, noise)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _fold_estimates(
    ema: NoiseScaleEMA,
    noise: NoiseMoments,
    rule: str,
    noise_estimates: NoiseEstimatesLike | None,
    batch: jax.Array,
) -> NoiseMoments:
    """The average with this window's estimates, weighted by its batch; the
    estimates are required for adascale. A traced NaN, infinite or negative
    batch leaves the average as it was."""
    if noise_estimates is None:
        if rule == "adascale":
            raise ValueError(
                'rule="adascale" needs the window\'s estimates: '
                "update(..., batch_size=stats.big_batch, noise_estimates=stats)."
            )
        return noise
    for name in ("gradient_norm_sq", "gradient_noise_trace"):
        check_reading(
            f"noise_estimates.{name}",
            getattr(noise_estimates, name),
            hint="Pass the window's WindowStats (or NoiseEstimates).",
        )
    window = _Window(
        batch,
        as_float32(noise_estimates.gradient_norm_sq),
        as_float32(noise_estimates.gradient_noise_trace),
    )
    return ema.update(noise, window)
