"""The noise-scale controller's update: the window's estimates folded in, and
the next window's size, moved only where the evidence puts the target."""

import functools

import jax
import jax.numpy as jnp

from jaxaccum.growth._base import keep_if, window_is_valid
from jaxaccum.growth._moments import fold_moments, read_moments
from jaxaccum.growth._noise_batch_state import (
    EXAMPLES_ONLY,
    MIN_EFFECTIVE_WINDOWS,
    STEPS_ONLY,
    NoiseScaleBatchState,
    Settings,
)


def scaled_time(controller: Settings, batch: jax.Array, phi: jax.Array) -> jax.Array:
    """The predicted time ``(1 + B_noise / B)(c + B)`` times ``phi =
    1 / B_noise`` (a factor common to every size, so the best size is the
    same), which stays finite for ``phi <= 0`` (an infinite noise scale)."""
    phi = jnp.maximum(phi, 0.0)
    steps = (phi * batch + 1.0) / batch
    if controller.step_cost == STEPS_ONLY:
        return steps
    return steps * (controller.step_cost + batch)


def measured_microbatch_weight(state: NoiseScaleBatchState) -> jax.Array:
    count = jnp.maximum(state.microbatches_seen, 1).astype(jnp.float32)
    return state.examples_seen.total / count


def best_size(controller: Settings, phi: jax.Array, weight: jax.Array) -> jax.Array:
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
        score = scaled_time(controller, batches, phi)
    return sizes[jnp.argmin(score)]


def next_size(controller: Settings, state: NoiseScaleBatchState) -> jax.Array:
    r"""The window after ``state``'s: moved only where the evidence puts the
    target, $\phi \pm z\,\mathrm{se}$ apart, wholly on one side of it; to
    the end of that band nearest the current window."""
    reading = read_moments(state.noise)
    band = controller.standard_errors * reading.standard_error
    weight = measured_microbatch_weight(state)
    phi = reading.inverse_noise_scale
    # A larger phi (a smaller noise scale) is a smaller target.
    smallest = best_size(controller, phi + band, weight)
    largest = best_size(controller, phi - band, weight)
    window = state.num_microbatches
    grow = smallest > window
    shrink = controller.shrink & (2 * largest <= window)
    moved = jnp.where(grow, smallest, jnp.where(shrink, largest, window))
    return jnp.where(reading.effective_windows >= MIN_EFFECTIVE_WINDOWS, moved, window)


@functools.partial(jax.jit, static_argnums=0)
def noise_scale_update(
    controller: Settings,
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
    counted = counted._replace(num_microbatches=next_size(controller, counted))
    return keep_if(window_is_valid(big_batch, seen), counted, state)
