r"""The noise estimates averaged over examples seen: :class:`NoiseMoments`
(the sums, a pytree) and :class:`NoiseScaleEMA` (their half-life, the fold
and the readers: $B_\text{noise}$, the averaged estimates, the standard
error). One average, used by the noise-scale controller, by AdaScale's gain
and by a user who only measures."""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum.growth._base import (
    WindowTotals,
    as_float32,
    check_big_batch,
    keep_if,
    static_positive,
)


class NoiseMoments(NamedTuple):
    """Moving averages over examples seen of the windows' noise estimates.

    A window of ``B`` (its ``big_batch``) multiplies the old sums by
    $2^{-B/h}$ (half-life $h$) and adds its estimates with weight
    $1 - 2^{-B/h}$: the average spans the same examples whatever the windows'
    size. Divide a sum by ``weight`` for its bias-corrected average
    (:class:`NoiseScaleEMA` reads them).

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


def fold_moments(
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
    return keep_if(usable, candidate, moments)


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


def read_moments(moments: NoiseMoments) -> NoiseReading:
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


@dataclasses.dataclass(frozen=True)
class NoiseScaleEMA:
    r"""The running noise scale: the windows' $|G|^2$ and
    $\operatorname{tr}(\Sigma)$ estimates averaged over examples seen, divided.

    A window's estimates are unbiased but noisy (its $|G|^2$ can be
    negative) and their ratio is biased: so, as gpt-neox does, this averages
    numerator and denominator apart and divides the averages. The averages
    count examples, not windows: a window of $B$ (its ``big_batch``:
    examples, or tokens with ``reduction="weighted"``) decays them by
    $2^{-B/h}$ and comes in with weight $1 - 2^{-B/h}$, and the readers
    divide by the total weight (the bias correction), so runs with different
    windows read the same average at the same examples seen. Windows with a
    NaN or infinite estimate (one micro-batch, a non-finite gradient) are
    left out. :class:`NoiseScaleBatch` keeps these averages
    (``controller.noise_ema``), as does ``scale_by_batch_learning_rate``'s
    ``"adascale"`` rule.

    Args:
      half_life: $h$, in the unit of ``big_batch``: a positive real number
        (kept as a Python float). A window under $2^{-24} h$ comes in with
        weight 0 (float32): keep $h$ within $2^{24}$ windows.

    Raises:
      TypeError: for a ``half_life`` that is not a concrete real scalar.
      ValueError: for one that is not positive, or that float32 cannot hold.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum, jaxaccum.growth
      >>> ema = jaxaccum.growth.NoiseScaleEMA(half_life=1024)
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> step = jaxaccum.value_and_grad(loss, 4, report_stats=True)
      >>> moments = ema.init()
      >>> x = jnp.arange(48.0).reshape(16, 3) / 48
      >>> (value, grads), stats = step(jnp.ones(3), x)
      >>> moments = ema.update(moments, stats)  # a window of 16 examples
      >>> int(moments.num_windows), bool(ema.noise_scale(moments) > 0)
      (1, True)
    """

    half_life: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "half_life",
            static_positive(
                "half_life", self.half_life, "In the unit of big_batch (examples)."
            ),
        )

    def init(self) -> NoiseMoments:
        """The moments before any window."""
        zero = jnp.zeros((), jnp.float32)
        return NoiseMoments(
            zero, zero, zero, zero, zero, zero, zero, zero.astype(jnp.int32)
        )

    def update(self, moments: NoiseMoments, stats: WindowTotals) -> NoiseMoments:
        """Folds one window's estimates in, weighted by its ``big_batch``.

        Jittable. It reads the scalars ``stats.big_batch``,
        ``stats.gradient_norm_sq`` and ``stats.gradient_noise_trace`` (a
        :class:`jaxaccum.WindowStats` has them; ``MultiSteps.window_stats``
        gives one).

        Returns:
          The moments after the window. A window whose ``big_batch`` is NaN,
          infinite or negative (a ``MultiSteps`` window read mid-window)
          leaves them exactly as they were.

        Raises:
          ValueError: for a concrete ``stats.big_batch`` that is NaN,
            infinite or negative, or estimates that are not scalars.
        """
        check_big_batch(stats.big_batch)
        for name in ("gradient_norm_sq", "gradient_noise_trace"):
            if jnp.shape(getattr(stats, name)) != ():
                raise ValueError(
                    f"stats.{name} must be a scalar, got shape "
                    f"{jnp.shape(getattr(stats, name))}; pass the window's "
                    "WindowStats."
                )
        totals = (stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace)
        return _ema_update(self, moments, *map(as_float32, totals))

    def gradient_norm_sq(self, moments: NoiseMoments) -> jax.Array:
        """The average $|G|^2$; NaN before any window."""
        return moments.norm_sq / moments.weight

    def gradient_noise_trace(self, moments: NoiseMoments) -> jax.Array:
        r"""The average $\operatorname{tr}(\Sigma)$; NaN before any window."""
        return moments.trace / moments.weight

    def noise_scale(self, moments: NoiseMoments) -> jax.Array:
        r"""$B_\text{noise}$, the ratio of the averages, in the unit of
        ``big_batch``: NaN before any window, negative or infinite where the
        average $|G|^2$ is not above 0 (the signal lost in the noise)."""
        return moments.trace / moments.norm_sq

    def standard_error(self, moments: NoiseMoments) -> jax.Array:
        r"""The standard error of $1 / B_\text{noise}$ (by the delta method,
        from the windows' spread), the controller's evidence band; inf with
        fewer than two effective windows."""
        return read_moments(moments).standard_error

    def effective_windows(self, moments: NoiseMoments) -> jax.Array:
        """The effective number of windows averaged, ``weight**2 /
        weight_sq``; NaN before any window."""
        return read_moments(moments).effective_windows


@functools.partial(jax.jit, static_argnums=0)
def _ema_update(
    ema: NoiseScaleEMA,
    moments: NoiseMoments,
    big_batch: jax.Array,
    gradient_norm_sq: jax.Array,
    gradient_noise_trace: jax.Array,
) -> NoiseMoments:
    folded = fold_moments(
        moments, big_batch, gradient_norm_sq, gradient_noise_trace, ema.half_life
    )
    return keep_if(jnp.isfinite(big_batch) & (big_batch >= 0), folded, moments)
