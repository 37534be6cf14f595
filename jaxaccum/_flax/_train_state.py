"""Flax Linen's train step and ``TrainState``: one accumulated step that
applies its gradients, and FP8 metadata moved once per `MultiSteps` window."""

from collections.abc import Sequence
from typing import Any

import flax.core
import optax
from flax.training import train_state
from typing_extensions import Unpack

from jaxaccum._flax._linen import (
    collection_names,
    holds_metadata,
    linen_options,
    linen_value_and_grad,
)
from jaxaccum._multisteps._multisteps import MultiSteps
from jaxaccum._precision._metadata import OVERWRITE_WITH_GRADIENT
from jaxaccum._types import Batch, FlaxKwargs, Fun, Grads, Params, PyTree


def linen_train_step(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    mutable: str | Sequence[str] = (),
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """A ``TrainState`` step: accumulate a window, then one ``apply_gradients``.

    Runs :func:`jaxaccum.flax.linen_value_and_grad` on ``{"params":
    state.params, <each mutable collection>: state.<collection>}`` and the batch,
    then calls
    ``state.apply_gradients`` once with the window's gradient and the updated
    collections: the optimizer, its step count and schedules see one step per
    window. Keep each mutable collection in a field of the same name, i.e.
    subclass ``flax.training.train_state.TrainState`` with ``batch_stats:
    Any``.

    Args:
      fun: as for :func:`jaxaccum.flax.linen_value_and_grad`; call
        ``model.apply`` (or ``state.apply_fn``, closed over) in it.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      mutable: the collections ``fun`` updates, stored back into ``state``.
      has_aux: whether ``fun``'s loss comes with aux, ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments.

    Returns:
      ``step(state, batch, *args, rngs=None, **kwargs) -> (new_state, loss)``
      (``(new_state, (loss, aux))`` with ``has_aux``; with ``report_finite``
      or ``report_stats``, the report last: ``(new_state, loss, report)``).
      Wrap it in ``jax.jit``. It applies the gradients whatever they are: with
      ``loss_scale=True`` keep ``jaxaccum.select_if_finite(report.finite,
      new_state, state)``, the old state where the window overflowed.

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
      >>> from flax.training import train_state
      >>> import jaxaccum.flax
      >>> class TrainState(train_state.TrainState):
      ...     batch_stats: dict
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False), nn.Dense(1)])
      >>> x = jnp.arange(24.0).reshape(8, 3)
      >>> variables = model.init(jax.random.key(0), x)
      >>> state = TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
      ...     params=variables["params"], batch_stats=variables["batch_stats"])
      >>> def loss_fn(variables, x):
      ...     out, updates = model.apply(variables, x, mutable="batch_stats")
      ...     return jnp.mean(out**2), updates
      >>> step = jax.jit(jaxaccum.flax.linen_train_step(
      ...     loss_fn, num_microbatches=4, mutable="batch_stats"))
      >>> state, loss = step(state, x)
      >>> int(state.step)
      1
    """
    collections = collection_names(mutable)
    reports = linen_options(
        "linen_train_step",
        num_microbatches,
        value_and_grad_kwargs,
        collections,
        has_aux,
    ).reports
    accumulate = linen_value_and_grad(
        fun,
        num_microbatches,
        mutable=collections,
        has_aux=has_aux,
        **value_and_grad_kwargs,
    )

    def step(
        state: train_state.TrainState,
        batch: Batch,
        *args: PyTree,
        rngs: Any = None,
        **kwargs: PyTree,
    ) -> tuple:
        missing = [name for name in collections if not hasattr(state, name)]
        if missing:
            raise AttributeError(
                f"{type(state).__name__} has no field(s) {missing} to keep the "
                "mutable collections in. Subclass TrainState with them, e.g. "
                "class TrainState(train_state.TrainState): batch_stats: Any."
            )
        variables = train_state_variables(state.params)
        variables.update({name: getattr(state, name) for name in collections})
        result = accumulate(variables, batch, *args, rngs=rngs, **kwargs)
        result, report = result if reports else (result, None)
        updates = {}
        if collections:
            result, updates = result
        loss, grads = result
        new_state = state.apply_gradients(grads=grads, **updates)
        return (new_state, loss) if report is None else (new_state, loss, report)

    return step


def train_state_variables(params: Params) -> dict:
    """A ``TrainState``'s ``params`` as Linen variables: Flax's FP8 recipe
    keeps the whole variables there (``params`` and the FP8 metadata)."""
    params = flax.core.unfreeze(params)
    if holds_metadata(params):
        return params
    return {"params": params}


def multisteps_of(tx: Any) -> MultiSteps | None:
    """The :class:`jaxaccum.MultiSteps` behind ``tx`` (``accumulate``'s
    transformation included), else None."""
    owner = getattr(getattr(tx, "init", None), "__self__", None)
    return owner if isinstance(owner, MultiSteps) else None


class TrainState(train_state.TrainState):
    """Flax's ``TrainState``, its FP8 metadata moved once per `MultiSteps` window.

    A drop-in for ``flax.training.train_state.TrainState``. Where ``tx`` is a
    :class:`jaxaccum.MultiSteps` (or ``jaxaccum.accumulate``) and ``params``
    holds FP8 metadata (Flax's ``_overwrite_with_gradient`` collection beside
    ``"params"``), ``apply_gradients`` hands each call's new metadata to the
    window (maxed over its calls) and keeps the window-start values in
    ``params`` until the window emits, when they become the window's: every
    call quantizes with the scales the big batch would, and the amax
    histories move once a window. Flax's own ``TrainState`` writes each
    call's metadata over the last, so with ``MultiSteps`` its histories roll
    once per call. Otherwise it is Flax's. Guide: [Mixed
    precision](../guides/mixed-precision.md#fp8-across-calls).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxaccum, jaxaccum.flax
      >>> params = {"params": {"w": jnp.zeros(2)},
      ...           "_overwrite_with_gradient": {"amax": jnp.zeros(1)}}
      >>> state = jaxaccum.flax.TrainState.create(
      ...     apply_fn=None, params=params, tx=jaxaccum.MultiSteps(optax.sgd(1.0), 2))
      >>> for amax in (3.0, 1.0):
      ...     grads = {"params": {"w": jnp.ones(2)},
      ...              "_overwrite_with_gradient": {"amax": jnp.full(1, amax)}}
      ...     state = state.apply_gradients(grads=grads)
      ...     print(state.params["_overwrite_with_gradient"]["amax"])
      [0.]
      [3.]
    """

    @classmethod
    def create(cls, *, apply_fn: Any, params: Params, tx: Any, **kwargs: PyTree) -> Any:
        """As Flax's ``create``; a `MultiSteps` ``tx`` also holds the metadata."""
        multisteps = multisteps_of(tx)
        if multisteps is None or OVERWRITE_WITH_GRADIENT not in params:
            return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        opt_state = multisteps.init(
            params["params"], metadata=params[OVERWRITE_WITH_GRADIENT]
        )
        return cls(
            step=0,
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            **kwargs,
        )

    def apply_gradients(self, *, grads: Grads, **kwargs: PyTree) -> Any:
        """As Flax's; the metadata held for a `MultiSteps` window (above)."""
        multisteps = multisteps_of(self.tx)
        if multisteps is None or OVERWRITE_WITH_GRADIENT not in grads:
            return super().apply_gradients(grads=grads, **kwargs)
        updates, opt_state = multisteps.update(
            grads["params"],
            self.opt_state,
            self.params["params"],
            metadata=grads[OVERWRITE_WITH_GRADIENT],
        )
        params = {
            "params": optax.apply_updates(self.params["params"], updates),
            OVERWRITE_WITH_GRADIENT: multisteps.metadata(
                opt_state, self.params[OVERWRITE_WITH_GRADIENT]
            ),
        }
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, **kwargs
        )
