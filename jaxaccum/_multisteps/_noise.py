"""A window's squared norms across calls: what ``MultiSteps`` keeps, with
``track_noise_scale``, to give a window's :class:`jaxaccum.WindowStats`.

Each accepted call adds ``w |g|^2`` (its weight times its gradient's squared
norm) and, if its weight is not 0, one to the count of calls; the emitting
call takes ``|G_B|^2`` of the window's mean gradient. From those, the window's
estimates are those of an in-step window of ``N`` micro-batches of ``b = W /
N`` (``W`` the window's weight).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._types import Grads
from jaxaccum._window._noise_scale import (
    WindowStats,
    estimate,
    in_stats_precision,
    squared_norm,
)
from jaxaccum._window._reduce import divide_by_total_weight


class WindowNoise(NamedTuple):
    """The squared norms of a window of calls.

    Attributes:
      sq_norm_sum: float32, the window's sum of ``w |g|^2`` over its accepted
        calls; reset like ``MultiStepsState.acc_grads``.
      calls: int32, the window's accepted calls of non-zero weight (its
        ``N``); reset alike.
      window_sq_norm: float32, ``|G_B|^2`` of the last emitted window's mean
        gradient.
    """

    sq_norm_sum: jax.Array
    calls: jax.Array
    window_sq_norm: jax.Array


def init_window_noise() -> WindowNoise:
    zero = jnp.zeros([], jnp.float32)
    return WindowNoise(zero, jnp.zeros([], jnp.int32), zero)


def add_call(
    noise: WindowNoise,
    updates: Grads,
    weight: jax.Array | None,
    into_window: Callable[[jax.Array, jax.Array], jax.Array],
) -> WindowNoise:
    """``noise`` with one call's gradient ``updates`` of ``weight`` added;
    ``into_window(sum, value)`` adds as the accumulator does (a new window's
    first call overwrites, a skipped call leaves)."""
    sq_norm = squared_norm(updates)
    if weight is not None:
        sq_norm = weight * sq_norm
    # As in-step, a call of weight 0 is no batch size: N counts the others.
    counted = jnp.ones([], jnp.int32) if weight is None else weight > 0
    return noise._replace(
        sq_norm_sum=into_window(noise.sq_norm_sum, sq_norm),
        calls=into_window(noise.calls, jnp.asarray(counted, jnp.int32)),
    )


def emitted(noise: WindowNoise, acc_grads: Grads, acc_weight: jax.Array) -> WindowNoise:
    """``noise`` at the emitting call: with ``|G_B|^2`` of the window's mean
    gradient, ``acc_grads / acc_weight``."""
    mean = divide_by_total_weight(
        jax.tree.map(in_stats_precision, acc_grads), acc_weight
    )
    return noise._replace(window_sq_norm=squared_norm(mean))


def window_stats(
    noise: WindowNoise, acc_weight: jax.Array, updated: jax.Array
) -> WindowStats:
    """The window's :class:`jaxaccum.WindowStats` from its sums (the
    per-micro-batch fields empty); NaN, and not finite, unless ``updated``
    (right after the emitting call)."""
    total = jnp.asarray(acc_weight, jnp.float32)
    calls = noise.calls.astype(jnp.float32)
    estimates = estimate(
        noise.sq_norm_sum / jnp.where(total > 0, total, 1.0),
        noise.window_sq_norm,
        total / jnp.maximum(calls, 1.0),
        total,
    )

    def nan_mid_window(value: jax.Array) -> jax.Array:
        return jnp.where(updated, value, jnp.full((), jnp.nan, jnp.float32))

    estimates = jax.tree.map(nan_mid_window, estimates)
    empty = jnp.zeros((0,), jnp.float32)
    return WindowStats(
        microbatch_grad_sq_norm=empty,
        grad_sq_norm=nan_mid_window(noise.window_sq_norm),
        small_batch=empty,
        big_batch=nan_mid_window(total),
        gradient_norm_sq=estimates.gradient_norm_sq,
        gradient_noise_trace=estimates.gradient_noise_trace,
        noise_scale=estimates.noise_scale,
        microbatch_finite=jnp.zeros((0,), jnp.bool_),
        finite=updated & jnp.isfinite(noise.sq_norm_sum + noise.window_sq_norm),
    )
