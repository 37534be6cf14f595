"""The state `MultiSteps` carries from call to call."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum._multisteps._noise import WindowNoise
from jaxaccum._precision._loss_scale import WindowLossScale
from jaxaccum._types import Grads, PyTree
from jaxaccum._window._accum_dtypes import accum_dtype_for


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`; the fields of `optax.MultiStepsState` plus three.

    Attributes:
      mini_step: int32 scalar, accepted calls so far in the current window;
        reset to 0 by the emitting call.
      gradient_step: int32 scalar, windows completed, i.e. inner optimizer steps.
      inner_opt_state: the state of the wrapped optimizer; it changes only on
        emitting calls.
      acc_grads: sum of ``weight * gradient`` over the window, in the
        accumulator dtype (optax stores a running mean here). The emitting call
        leaves in it the updates it emitted (in the accumulator dtype): the
        wrapped optimizer has read the sum by then, and carrying the updates
        out through this buffer spares every call a parameter-sized temporary
        (see `MultiSteps`). The next accepted call, which starts a new window,
        overwrites it: this lazy reset saves a pass over the accumulator.
      skip_state: whatever ``should_skip_update_fn`` returned on the last call
        (monitoring information), ``()`` without one.
      acc_weight: float32 scalar, the window's total weight (the number of
        accepted calls when no ``weight`` is passed); reset like ``acc_grads``.
      noise: with ``track_noise_scale``, the window's squared norms (a
        ``WindowNoise``: their sum over calls, the calls counted, the last
        emitted window's); ``()`` without.
      loss_scale: with ``loss_scale``, a ``WindowLossScale``: the window's
        :class:`jaxaccum.DynamicLossScale` and whether its calls were all
        finite; ``()`` without.
      metadata: with ``init(..., metadata=)``, the FP8 metadata's maximum over
        the window's accepted calls, in float32 (reset like ``acc_grads``):
        the window's new metadata once it emits; ``()`` without.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: PyTree
    acc_grads: Grads
    skip_state: Any = ()
    acc_weight: jax.Array | float = 0.0
    noise: WindowNoise | tuple = ()
    loss_scale: WindowLossScale | tuple = ()
    metadata: PyTree = ()


def zero_accumulator(params: optax.Params, accumulator_dtype: Any) -> PyTree:
    """Zeros like ``params``, each in its dtype promoted to ``accumulator_dtype``."""
    return jax.tree.map(
        lambda param: jnp.zeros_like(
            param, accum_dtype_for(param.dtype, accumulator_dtype)
        ),
        params,
    )
