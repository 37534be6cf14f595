r"""Is the big batch worth it? The gradient noise scale from a window's gradients.

A window holds gradients at two batch sizes: each micro-batch's (small,
:math:`b`) and the window's (big, :math:`B`). The squared norm of a mean
gradient over :math:`w` independent examples has expectation
:math:`|G|^2 + \operatorname{tr}(\Sigma) / w` (:math:`G` the true gradient,
:math:`\Sigma` the per-example covariance), so the two sizes give unbiased
estimates of both (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1), and their ratio
:math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2` says roughly where
a bigger batch stops cutting the number of steps.

It holds one window's statistics, :class:`WindowStats` (from
:func:`window_stats`, over the micro-batches' :class:`MicroStats`), and its
estimates, :class:`NoiseEstimates` (:func:`estimate`). Averaged over a run,
they are :class:`jaxaccum.growth.NoiseScaleEMA`'s.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxaccum._types import PyTree


def in_stats_precision(leaf: PyTree) -> jax.Array:
    """``leaf`` in float32, or complex64 if it is complex: a cast to a real
    dtype would drop the imaginary part."""
    leaf = jnp.asarray(leaf)
    if jnp.iscomplexobj(leaf):
        return leaf.astype(jnp.complex64)
    return leaf.astype(jnp.float32)


def squared_norm(tree: PyTree) -> jax.Array:
    """The float32 squared norm of a pytree: ``sum real(x * conj(x))`` over
    its leaves, complex leaves included (``optax.tree.norm`` squares a complex
    leaf's real and imaginary parts)."""
    return optax.tree.norm(jax.tree.map(in_stats_precision, tree), squared=True)


def unscaled_squared_norm(tree: PyTree, scale: Any) -> jax.Array:
    """The float32 squared norm of ``tree / scale`` (0 where ``scale`` is 0):
    a scaled gradient's own, the scale divided out of each leaf before
    squaring (a squared scale of 2**64 overflows float32, and a squared
    share of a large window underflows)."""
    scale = jnp.asarray(scale, jnp.float32)
    positive = scale > 0
    safe = jnp.where(positive, scale, 1)
    leaves = jax.tree.map(lambda leaf: in_stats_precision(leaf) / safe, tree)
    return jnp.where(positive, squared_norm(leaves), 0)


class WindowStats(NamedTuple):
    r"""What one window's gradients say about the batch size.

    Returned by :func:`jaxaccum.value_and_grad` with ``report_stats=True``.
    Batch sizes are weights: examples, or with ``reduction="weighted"`` the
    weight ``fun`` returns (tokens, say).

    The estimators. Micro-batch :math:`k` has weight :math:`w_k` and mean
    gradient :math:`G_k` (its loss gradient divided by :math:`w_k` for
    ``"sum"`` and ``"weighted"``); the window has :math:`W = \sum_k w_k` and
    mean gradient :math:`G_B = \sum_k w_k G_k / W`. With per-example gradients
    of mean :math:`G` and covariance :math:`\Sigma`,
    :math:`\mathbb{E}|G_k|^2 = |G|^2 + \operatorname{tr}(\Sigma) / w_k` and
    :math:`\mathbb{E}|G_B|^2 = |G|^2 + \operatorname{tr}(\Sigma) / W`. The
    weight-weighted mean of the micro-batch norms,
    :math:`S_b = \sum_k (w_k / W)\, |G_k|^2`, then has expectation
    :math:`|G|^2 + \operatorname{tr}(\Sigma)\, N' / W` (:math:`N'`
    micro-batches of non-zero weight): it behaves as one batch of
    :math:`b = W / N'`, which is :math:`B / N` for equal micro-batches. With
    :math:`S_B = |G_B|^2` and :math:`B = W`:

    * :math:`|G|^2 \approx \dfrac{B S_B - b S_b}{B - b}`
    * :math:`\operatorname{tr}(\Sigma) \approx \dfrac{S_b - S_B}{1/b - 1/B}`

    Each is unbiased; their ratio is not, so over a run average the two (see
    :class:`jaxaccum.growth.NoiseScaleEMA`) and divide the averages. With one
    micro-batch (:math:`N' = 1`) there is one batch size and both are NaN, as
    is the noise scale: that is not an error. Under ``shard_value_and_grad``
    every device's micro-batches count: :math:`N' = N D` of :math:`B / (N D)`
    rows each. A squared norm is
    :math:`\sum \operatorname{Re}(x \bar{x})` over every leaf, complex ones
    included.

    Attributes:
      microbatch_grad_sq_norm: float32 ``(N,)``, :math:`|G_k|^2` (under
        ``shard_value_and_grad``, the mean over devices).
      grad_sq_norm: float32, :math:`|G_B|^2`, the squared norm of the window's
        mean gradient: the returned gradient's, except for ``"sum"``, where it
        is that of the returned gradient divided by :math:`W`. So every field is
        the same for a sum loss as for the mean loss on the same data.
      small_batch: float32 ``(N,)``, each micro-batch's weight :math:`w_k` (summed
        over devices under ``shard_value_and_grad``).
      big_batch: float32, :math:`B = W`.
      gradient_norm_sq: the unbiased estimate of :math:`|G|^2`.
      gradient_noise_trace: the unbiased estimate of
        :math:`\operatorname{tr}(\Sigma)`.
      noise_scale: ``gradient_noise_trace / gradient_norm_sq``, this window's
        (noisy) :math:`B_\text{simple}`, in the units of ``big_batch``.
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
    r"""The gradient noise estimates from two batch sizes (McCandlish et al. 2018).

    From the expected squared norm of a gradient averaged over ``b`` examples,
    :math:`\mathbb{E}|G_b|^2 = |G|^2 + \operatorname{tr}(\Sigma) / b`, taken
    at the micro-batches' size and at the window's (see :class:`WindowStats`).
    NaN when there is one batch size (one micro-batch).

    Attributes:
      gradient_norm_sq: unbiased estimate of the true gradient's squared norm
        :math:`|G|^2`.
      gradient_noise_trace: unbiased estimate of
        :math:`\operatorname{tr}(\Sigma)`, the trace of the per-example
        gradient covariance (with ``reduction="weighted"``: per unit of weight,
        e.g. per token).
      noise_scale: the simple noise scale
        :math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2`, in
        examples (or weight units). One window's ratio is noisy and biased:
        average numerator and denominator over windows with
        :class:`jaxaccum.growth.NoiseScaleEMA`.
    """

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


def _divide_squared(sq_norm: jax.Array, scale: jax.Array) -> jax.Array:
    """``sq_norm / scale^2``: the squared norm of a gradient divided by
    ``scale``; 0 where ``scale`` is 0 (a micro-batch or window of no weight)."""
    nonzero = scale > 0
    return jnp.where(nonzero, sq_norm / jnp.where(nonzero, scale, 1.0) ** 2, 0.0)


def window_stats(
    micro: MicroStats,
    window_sq_norm: jax.Array,
    reduction: str,
    data_axes: tuple[str, ...],
) -> WindowStats:
    """The :class:`WindowStats` of a window from its stacked micro-batch stats
    and the float32 squared norm of its gradient sum (``sum_k g_k``, over the
    devices too, before normalisation).

    This is where every reduction's gradients become mean gradients, the micro-
    batches' and the window's alike: ``fun``'s gradient ``g_k`` is ``scale_k
    G_k`` with ``scale_k = 1`` for ``"mean"`` and ``w_k`` for ``"sum"`` and
    ``"weighted"``, so ``G_k = g_k / scale_k`` and ``G_B = sum_k g_k / sum_k
    scale_k`` (for ``"mean"``, the mean over the ``N`` micro-batches; a
    micro-batch skipped by ``masked`` has weight 0 and counts in neither).
    """
    weight = jnp.asarray(micro.weight, jnp.float32)
    # A mean loss's gradient is already a mean: scale 1, or 0 where skipped.
    scale = (weight > 0).astype(jnp.float32) if reduction == "mean" else weight
    mean_sq = _divide_squared(jnp.asarray(micro.grad_sq_norm, jnp.float32), scale)
    has_weight = weight > 0
    totals = (
        jnp.sum(jnp.where(has_weight, weight * mean_sq, 0.0)),
        jnp.sum(has_weight, dtype=jnp.float32),
        jnp.sum(weight),
        jnp.sum(scale),
    )
    finite = micro.finite
    if data_axes:
        totals = lax.psum(totals, data_axes)
        mean_sq = lax.pmean(mean_sq, data_axes)
        weight = lax.psum(weight, data_axes)
        finite = lax.pmin(finite.astype(jnp.int32), data_axes).astype(bool)
    contributions, num_weighted, total_weight, total_scale = totals
    grad_sq_norm = _divide_squared(window_sq_norm, total_scale)
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
