"""Is the big batch worth it? The gradient noise scale from a window's gradients.

A window holds gradients at two batch sizes: each micro-batch's (small, ``b``)
and the window's (big, ``B``). The squared norm of a mean gradient over ``w``
independent examples has expectation ``|G|^2 + tr(Sigma) / w`` (``G`` the true
gradient, ``Sigma`` the per-example covariance), so the two sizes give unbiased
estimates of both (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1), and their ratio ``B_simple = tr(Sigma) / |G|^2``
says roughly where a bigger batch stops cutting the number of steps.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class WindowStats(NamedTuple):
    """What one window's gradients say about the batch size.

    Returned by :func:`jaxaccum.value_and_grad` with ``report_stats=True``.
    Batch sizes are weights: examples, or with ``reduction="weighted"`` the
    weight ``fun`` returns (tokens, say).

    The estimators. Micro-batch ``k`` has weight ``w_k`` and mean gradient
    ``G_k`` (its loss gradient divided by ``w_k`` for ``"sum"`` and
    ``"weighted"``); the window has ``W = sum_k w_k`` and mean gradient
    ``G_B = sum_k w_k G_k / W``. With per-example gradients of mean ``G`` and
    covariance ``Sigma``, ``E|G_k|^2 = |G|^2 + tr(Sigma) / w_k`` and
    ``E|G_B|^2 = |G|^2 + tr(Sigma) / W``. The weight-weighted mean of the
    micro-batch norms, ``S_b = sum_k (w_k / W) |G_k|^2``, then has expectation
    ``|G|^2 + tr(Sigma) N' / W`` (``N'`` micro-batches of non-zero weight):
    it behaves as one batch of ``b = W / N'``, which is ``B / N`` for equal
    micro-batches. With ``S_B = |G_B|^2`` and ``B = W``:

    * ``|G|^2 ~ (B S_B - b S_b) / (B - b)``
    * ``tr(Sigma) ~ (S_b - S_B) / (1 / b - 1 / B)``

    Each is unbiased; their ratio is not, so over a run average the two (see
    :class:`NoiseScaleEMA`) and divide the averages. With one micro-batch
    (``N' == 1``) there is one batch size and both are NaN, as is the noise
    scale: that is not an error. Under ``shard_value_and_grad`` every device's
    micro-batches count: ``N' = N D`` of ``B / (N D)`` rows each.

    Attributes:
      microbatch_grad_sq_norm: float32 ``(N,)``, ``|G_k|^2`` (under
        ``shard_value_and_grad``, the mean over devices).
      grad_sq_norm: float32, ``|G_B|^2``, the window gradient's squared norm.
      small_batch: float32 ``(N,)``, each micro-batch's weight ``w_k`` (summed
        over devices under ``shard_value_and_grad``).
      big_batch: float32, ``B = W``.
      gradient_norm_sq: the unbiased estimate of ``|G|^2``.
      gradient_noise_trace: the unbiased estimate of ``tr(Sigma)``.
      noise_scale: ``gradient_noise_trace / gradient_norm_sq``, this window's
        (noisy) ``B_simple``, in the units of ``big_batch``.
      microbatch_finite: bool ``(N,)``, as in :class:`jaxaccum.FiniteReport`.
      finite: bool, all of them.
    """

    microbatch_grad_sq_norm: jax.Array
    grad_sq_norm: jax.Array
    small_batch: jax.Array
    big_batch: jax.Array
    gradient_norm_sq: jax.Array
    gradient_noise_trace: jax.Array
    noise_scale: jax.Array
    microbatch_finite: jax.Array
    finite: jax.Array


class NoiseEstimates(NamedTuple):
    """The estimates from two batch sizes (see :class:`WindowStats`)."""

    gradient_norm_sq: jax.Array
    gradient_noise_trace: jax.Array
    noise_scale: jax.Array


def estimate(
    small_sq_norm: jax.Array,
    big_sq_norm: jax.Array,
    small_batch: jax.Array,
    big_batch: jax.Array,
) -> NoiseEstimates:
    """McCandlish et al.'s unbiased estimates from ``|G_b|^2`` at batch ``b``
    and ``|G_B|^2`` at ``B``; NaN where ``b == B`` (one batch size only)."""
    two_sizes = big_batch > small_batch
    big = jnp.where(two_sizes, big_batch, 2.0)  # keeps the NaN branch finite
    small = jnp.where(two_sizes, small_batch, 1.0)
    norm_sq = (big * big_sq_norm - small * small_sq_norm) / (big - small)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / small - 1.0 / big)
    nan = jnp.full((), jnp.nan, jnp.float32)
    norm_sq, trace = (jnp.where(two_sizes, x, nan) for x in (norm_sq, trace))
    return NoiseEstimates(norm_sq, trace, trace / norm_sq)


class MicroStats(NamedTuple):
    """Per micro-batch, taken inside the scan (stacked over micro-batches).

    Attributes:
      finite: whether the micro-batch's loss and gradient are finite.
      grad_sq_norm: float32 squared norm of the gradient of its loss as
        ``fun`` returns it (``()`` without ``report_stats``).
      weight: its weight: the real examples, or the weight of
        ``reduction="weighted"`` (``()`` without ``report_stats``).
    """

    finite: jax.Array
    grad_sq_norm: jax.Array | tuple
    weight: jax.Array | tuple


def window_stats(
    micro: MicroStats,
    grad_sq_norm: jax.Array,
    reduction: str,
    data_axes: tuple[str, ...],
) -> WindowStats:
    """The :class:`WindowStats` of a window from its stacked micro-batch stats
    and its (normalised, float32) gradient's squared norm."""
    weight = jnp.asarray(micro.weight, jnp.float32)
    raw = jnp.asarray(micro.grad_sq_norm, jnp.float32)
    has_weight = weight > 0
    if reduction == "mean":
        mean_sq = raw  # fun's loss is already a mean over its micro-batch
    else:
        mean_sq = jnp.where(has_weight, raw / jnp.where(has_weight, weight, 1) ** 2, 0)
    contributions = jnp.sum(jnp.where(has_weight, weight * mean_sq, 0.0))
    totals = (contributions, jnp.sum(has_weight, dtype=jnp.float32), jnp.sum(weight))
    finite = micro.finite
    if data_axes:
        totals = lax.psum(totals, data_axes)
        mean_sq = lax.pmean(mean_sq, data_axes)
        weight = lax.psum(weight, data_axes)
        finite = lax.pmin(finite.astype(jnp.int32), data_axes).astype(bool)
    contributions, num_weighted, total_weight = totals
    safe_total = jnp.where(total_weight > 0, total_weight, 1.0)
    small_sq_norm = contributions / safe_total
    small_batch = total_weight / jnp.maximum(num_weighted, 1.0)
    estimates = estimate(small_sq_norm, grad_sq_norm, small_batch, total_weight)
    return WindowStats(
        microbatch_grad_sq_norm=mean_sq,
        grad_sq_norm=grad_sq_norm,
        small_batch=weight,
        big_batch=total_weight,
        gradient_norm_sq=estimates.gradient_norm_sq,
        gradient_noise_trace=estimates.gradient_noise_trace,
        noise_scale=estimates.noise_scale,
        microbatch_finite=finite,
        finite=jnp.all(finite),
    )


class NoiseScaleState(NamedTuple):
    """The state of :class:`NoiseScaleEMA`: a pytree, checkpointable as it is.

    Attributes:
      gradient_norm_sq: EMA of the ``|G|^2`` estimates (not bias-corrected).
      gradient_noise_trace: EMA of the ``tr(Sigma)`` estimates (likewise).
      num_windows: int32, windows averaged so far (those with finite
        estimates).
    """

    gradient_norm_sq: jax.Array
    gradient_noise_trace: jax.Array
    num_windows: jax.Array


class NoiseScaleEMA:
    """Running ``B_simple``: averages of ``|G|^2`` and ``tr(Sigma)``, divided.

    Each window's estimates are unbiased but noisy (a window's ``|G|^2``
    estimate can be negative); their ratio is biased. So, as gpt-neox does,
    this keeps exponential moving averages of the numerator and the
    denominator separately, bias-corrected as in Adam (``1 - decay^num_windows``),
    and :meth:`noise_scale` divides the averages. Windows with a NaN or
    infinite estimate (one micro-batch, a non-finite gradient) are skipped.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> ema = jaxaccum.NoiseScaleEMA(decay=0.9)
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> step = jaxaccum.value_and_grad(loss, 4, report_stats=True)
      >>> state = ema.init()
      >>> x = jnp.arange(48.0).reshape(16, 3) / 48
      >>> (value, grads), stats = step(jnp.ones(3), x)
      >>> state = ema.update(state, stats)
      >>> int(state.num_windows), bool(ema.noise_scale(state) > 0)
      (1, True)
    """

    def __init__(self, decay: float = 0.99):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}.")
        self.decay = decay

    def init(self) -> NoiseScaleState:
        """The state before any window."""
        zero = jnp.zeros((), jnp.float32)
        return NoiseScaleState(zero, zero, jnp.zeros((), jnp.int32))

    def update(
        self, state: NoiseScaleState, stats: WindowStats | NoiseEstimates
    ) -> NoiseScaleState:
        """Folds one window's estimates into the averages (jittable)."""
        new = (stats.gradient_norm_sq, stats.gradient_noise_trace)
        usable = jnp.isfinite(new[0]) & jnp.isfinite(new[1])
        old = (state.gradient_norm_sq, state.gradient_noise_trace)
        averaged = [
            jnp.where(usable, self.decay * o + (1 - self.decay) * n, o)
            for o, n in zip(old, new, strict=True)
        ]
        return NoiseScaleState(
            averaged[0], averaged[1], state.num_windows + usable.astype(jnp.int32)
        )

    def _corrected(self, state: NoiseScaleState) -> tuple[jax.Array, jax.Array]:
        correction = 1 - self.decay ** state.num_windows.astype(jnp.float32)
        correction = jnp.where(state.num_windows > 0, correction, jnp.nan)
        return (
            state.gradient_norm_sq / correction,
            state.gradient_noise_trace / correction,
        )

    def gradient_norm_sq(self, state: NoiseScaleState) -> jax.Array:
        """The bias-corrected average ``|G|^2``; NaN before any window."""
        return self._corrected(state)[0]

    def gradient_noise_trace(self, state: NoiseScaleState) -> jax.Array:
        """The bias-corrected average ``tr(Sigma)``; NaN before any window."""
        return self._corrected(state)[1]

    def noise_scale(self, state: NoiseScaleState) -> jax.Array:
        """``B_simple``: the ratio of the averages; NaN before any window."""
        norm_sq, trace = self._corrected(state)
        return trace / norm_sq
