"""`accumulate`: `MultiSteps` as a plain ``optax`` transformation."""

import jax
import jax.numpy as jnp
import optax

from jaxaccum._multisteps._inputs import EveryKSchedule, refuse_axis_name
from jaxaccum._multisteps._multisteps import MultiSteps
from jaxaccum._precision._loss_scale import DynamicLossScale


def accumulate(
    opt: optax.GradientTransformation,
    every_k: EveryKSchedule | None,
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
    accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
    track_noise_scale: bool = False,
    loss_scale: DynamicLossScale | None = None,
    axis_name: None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``opt`` to step once per ``every_k`` calls; functional `MultiSteps`.

    Args:
      opt: the wrapped optimizer.
      every_k: calls per window, an int >= 1 or a function of
        ``gradient_step``; or None, with ``update(..., every_k=...)`` on every
        call (see :meth:`MultiSteps.update`).
      use_grad_mean: emit the window's (weighted) mean if True, else its sum.
      should_skip_update_fn: optional, e.g. ``optax.skip_not_finite``.
      accumulator_dtype: dtype of the accumulator, float32 by default.
      track_noise_scale: keep the window's squared gradient norms (see
        :meth:`MultiSteps.noise_estimates`).
      loss_scale: a :class:`jaxaccum.DynamicLossScale` held per window (see
        :class:`MultiSteps`; read it from the state's ``loss_scale.scale``).
      axis_name: not taken (a ``TypeError`` if given), as for `MultiSteps`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `MultiStepsState` and whose ``update`` accepts ``weight=`` and
      ``every_k=``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum
      >>> opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
      >>> opt = jaxaccum.accumulate(opt, every_k=4)
      >>> params = {"w": jnp.zeros(3)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.ones(3)}, state, params, weight=7)
      >>> updates["w"]
      Array([0., 0., 0.], dtype=float32)
    """
    refuse_axis_name(axis_name, "accumulate")
    return MultiSteps(
        opt,
        every_k,
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        accumulator_dtype=accumulator_dtype,
        track_noise_scale=track_noise_scale,
        loss_scale=loss_scale,
    ).gradient_transformation()
