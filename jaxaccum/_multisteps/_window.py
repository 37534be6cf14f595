"""What one `MultiSteps` call does to its window: whether it is dropped or
closes the window, its share of the window's sums, and the emitting call's
run of the wrapped optimizer."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum._multisteps import _noise as _window_noise
from jaxaccum._multisteps._noise import WindowNoise
from jaxaccum._multisteps._state import MultiStepsState
from jaxaccum._precision import _loss_scale
from jaxaccum._precision._loss_scale import DynamicLossScale, WindowLossScale
from jaxaccum._types import Grads, PyTree


class WindowSums(NamedTuple):
    """The window's sums after a call, lazily reset like ``acc_grads``."""

    acc_grads: Grads
    acc_weight: jax.Array
    noise: WindowNoise | tuple


def unscaled_call(
    updates: optax.Updates, window: WindowLossScale, weight: jax.Array | None
) -> tuple[Any, jax.Array]:
    """This call's gradient unscaled (in at least float32), and whether it
    (and its weight) is finite."""
    finite = _loss_scale.tree_finite(updates)
    if weight is not None:
        finite = finite & jnp.isfinite(weight)
    return _loss_scale.unscale(updates, window.scale.loss_scale), finite


class Verdict(NamedTuple):
    """What a call does to its window: dropped (``should_skip_update_fn``),
    closing it, applying it (emitting), and the loss scale after the call."""

    should_skip: jax.Array
    closes: jax.Array
    emit: jax.Array
    loss_scale: WindowLossScale | tuple


def verdict(
    state: MultiStepsState,
    should_skip: jax.Array,
    call_finite: jax.Array | None,
    every_k: jax.typing.ArrayLike,
) -> Verdict:
    """The call's :class:`Verdict`; ``call_finite`` (with a loss scale)
    whether its gradient was finite, else None."""
    if call_finite is not None:
        # A call that is not finite is the window's: it counts, and the window
        # it belongs to is skipped whole.
        should_skip = should_skip & call_finite
    closes = jnp.logical_and(~should_skip, state.mini_step + 1 >= every_k)
    if call_finite is None:
        return Verdict(should_skip, closes, closes, state.loss_scale)
    assert isinstance(state.loss_scale, WindowLossScale)  # checked by update
    loss_scale = _loss_scale.after_call(
        state.loss_scale, call_finite, state.mini_step == 0, should_skip, closes
    )
    return Verdict(should_skip, closes, closes & loss_scale.finite, loss_scale)


def inner_update(
    opt: optax.GradientTransformationExtraArgs,
    grads: Grads,
    inner_opt_state: PyTree,
    updates: optax.Updates,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> tuple[optax.Updates, Any]:
    """The emitting call: the wrapped optimizer on the window's gradient, cast
    like this call's ``updates``."""
    new_updates, new_inner_state = opt.update(
        optax.tree.cast_like(grads, updates), inner_opt_state, params, **extra_args
    )
    # Both branches must return the same dtypes; keep the state's (as optax
    # does), which also keeps it stable as a lax.scan carry.
    new_inner_state = jax.tree.map(
        lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
        new_inner_state,
        inner_opt_state,
    )
    return new_updates, new_inner_state


def add_call(
    updates: optax.Updates,
    state: MultiStepsState,
    weight: jax.Array | None,
    should_skip: jax.Array,
) -> WindowSums:
    """This call's share of the window's sums."""
    # The reset is lazy: the first accepted call of a window overwrites the
    # previous window's sum instead of an extra pass writing zeros.
    window_start = state.mini_step == 0

    def into_window(acc: jax.Array, value: jax.Array) -> jax.Array:
        new_sum = jnp.where(window_start, value, acc + value)
        # Selects, not branches: they fuse into the add's single pass.
        return jnp.where(should_skip, acc, new_sum)

    def add_to_window(acc: jax.Array, grad: jax.Array) -> jax.Array:
        grad = grad.astype(acc.dtype)
        if weight is not None:
            grad = weight.astype(acc.dtype) * grad
        return into_window(acc, grad)

    acc_grads = jax.tree.map(add_to_window, state.acc_grads, updates)
    acc_weight = add_to_window(
        jnp.asarray(state.acc_weight, jnp.float32), jnp.ones([], jnp.float32)
    )
    noise = state.noise
    if isinstance(noise, WindowNoise):  # track_noise_scale
        noise = _window_noise.add_call(noise, updates, weight, into_window)
    return WindowSums(acc_grads, acc_weight, noise)


def close_or_carry(
    emit: jax.Array,
    sums: WindowSums,
    inner_opt_state: PyTree,
    emit_window: Callable[[Any, Any], tuple[optax.Updates, Any]],
) -> tuple[optax.Updates, Any, WindowSums]:
    """The call's updates, inner state and sums: ``emit_window``'s on the
    emitting call, else zeros and the state passed through."""

    def emit_into_accumulator(acc_grads, inner_opt_state):
        # The window's sum is dead once the inner optimizer has read it: its
        # buffer carries the updates out of the cond (see below).
        new_updates, new_inner_state = emit_window(acc_grads, inner_opt_state)
        carried = jax.tree.map(
            lambda update, acc: update.astype(acc.dtype), new_updates, acc_grads
        )
        noise = sums.noise
        if isinstance(noise, WindowNoise):  # track_noise_scale
            noise = _window_noise.emitted(noise, acc_grads, sums.acc_weight)
        return carried, new_inner_state, noise

    def mid_window(acc_grads, inner_opt_state):
        return acc_grads, inner_opt_state, sums.noise

    # Mid-window the accumulator and the inner state pass through the cond
    # untouched; with the state donated, XLA keeps both in place. The updates
    # are selected outside the cond, from the accumulator's buffer: a cond
    # output of their own would be a parameter-sized temporary, freshly
    # allocated (and page-faulted) by every call, while a select fuses into
    # the caller's `params + updates`.
    update_shapes, _ = jax.eval_shape(emit_window, sums.acc_grads, inner_opt_state)
    acc_grads, inner_opt_state, noise = jax.lax.cond(
        emit, emit_into_accumulator, mid_window, sums.acc_grads, inner_opt_state
    )
    new_updates = jax.tree.map(
        lambda acc, shape: jnp.where(
            emit, acc.astype(shape.dtype), jnp.zeros((), shape.dtype)
        ),
        acc_grads,
        update_shapes,
    )
    return new_updates, inner_opt_state, sums._replace(acc_grads=acc_grads, noise=noise)


def counters(
    state: MultiStepsState, closes: jax.Array, should_skip: jax.Array, emit: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``mini_step`` and ``gradient_step`` after a call: the first reset when
    the call closes its window (emitted or skipped whole), kept when the call
    is dropped; the second advanced when it emits."""
    mini_step = jnp.where(
        closes, 0, jnp.where(should_skip, state.mini_step, state.mini_step + 1)
    ).astype(jnp.int32)
    gradient_step = jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
    )
    return mini_step, gradient_step


def window_scale(
    loss_scale: DynamicLossScale | None, state: MultiStepsState, method: str
) -> WindowLossScale:
    """The state's window loss scale, or an error naming ``method``."""
    if loss_scale is None or not isinstance(state.loss_scale, WindowLossScale):
        raise ValueError(
            f"{method} needs the window's loss scale: build "
            "MultiSteps(..., loss_scale=jaxaccum.dynamic_loss_scale()) and "
            "pass the state its init returned."
        )
    return state.loss_scale
