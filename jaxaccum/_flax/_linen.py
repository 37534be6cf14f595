"""Flax Linen: accumulate a loss that calls ``model.apply``, its mutable
collections (BatchNorm's ``batch_stats``) carried in order."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.core
from typing_extensions import Unpack

from jaxaccum._checks import check_accepts_example_mask
from jaxaccum._precision._metadata import OVERWRITE_WITH_GRADIENT
from jaxaccum._types import Batch, FlaxKwargs, Fun, Params, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import WindowSpec


def collection_names(mutable: str | Sequence[str] | bool) -> tuple[str, ...]:
    if isinstance(mutable, str):
        return (mutable,)
    if not isinstance(mutable, Sequence) or not all(
        isinstance(name, str) for name in mutable
    ):
        raise TypeError(
            "mutable must name the collections fun updates, e.g. "
            f"mutable='batch_stats' or ['batch_stats'], got {mutable!r}."
        )
    return tuple(mutable)


def linen_options(
    where: str,
    num_microbatches: int | None,
    options: Mapping[str, Any],
    collections: tuple[str, ...],
    has_aux: bool,
) -> WindowSpec:
    """A Linen front end's options: ``fun(variables, batch, ...)`` split as
    params (differentiated), state (the mutable collections), batch, rngs."""
    return WindowSpec.create(
        where,
        num_microbatches,
        options,
        FlaxKwargs,
        fixed={
            "argnums": 0,
            "batch_argnums": 2,
            "key_argnums": 3,
            "state_argnums": 1 if collections else (),
            "has_aux": has_aux,
        },
        refused=SHARD_OPTIONS,
    )


def linen_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    mutable: str | Sequence[str] = (),
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """Accumulates a loss that calls a Linen ``model.apply``, state and rngs too.

    The ``"params"`` collection is differentiated; the ``mutable`` collections
    are carried through the micro-batches in order, so BatchNorm's
    ``batch_stats`` after a window equal ``N`` sequential training-mode forward
    passes; other collections are passed unchanged. Each ``rngs`` stream's key
    is split per micro-batch. Guide: [Flax](../guides/flax.md#linen).

    Args:
      fun: ``fun(variables, batch, *args, **kwargs)``, calling ``model.apply``
        (with ``rngs=``, passed as a keyword when the caller passes ``rngs``).
        Returns ``(out, updates)`` with ``mutable`` (``updates`` the collections
        ``apply`` returned), else ``out``; ``out`` is the loss, or ``(loss,
        aux)`` with ``has_aux``, or what ``reduction="weighted"`` expects.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      mutable: the collections ``fun`` updates (what it passes to ``apply``'s
        ``mutable``), e.g. ``"batch_stats"``.
      has_aux: whether ``out`` is ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``microbatch_size``, ``reduction``, ``aux_reduction``,
        ``accum_dtype``, ``pad``, ``unroll``, ``remat``).

    Returns:
      ``accumulated(variables, batch, *args, rngs=None, **kwargs)`` returning
      ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), where
      ``grads`` is like ``variables["params"]``; where ``variables`` hold FP8
      metadata (Flax's ``_overwrite_with_gradient`` collection), ``grads``
      is ``{"params": ..., "_overwrite_with_gradient": <its new values>}``,
      what ``TrainState.apply_gradients`` takes; with ``mutable``,
      ``(that, updates)``, ``updates`` holding the ``mutable`` collections after
      the window, as ``apply`` returns them; with ``report_finite`` or
      ``report_stats``, ``(all that, report)``.

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import jaxaccum.flax
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False), nn.Dense(1)])
      >>> x = jnp.arange(24.0).reshape(8, 3)
      >>> variables = model.init(jax.random.key(0), x)
      >>> def loss_fn(variables, x):
      ...     out, updates = model.apply(variables, x, mutable="batch_stats")
      ...     return jnp.mean(out**2), updates
      >>> accumulated = jaxaccum.flax.linen_value_and_grad(
      ...     loss_fn, num_microbatches=2, mutable="batch_stats")
      >>> (loss, grads), updates = jax.jit(accumulated)(variables, x)
      >>> jax.tree.map(jnp.shape, updates)
      {'batch_stats': {'layers_1': {'mean': (4,), 'var': (4,)}}}
    """
    collections = collection_names(mutable)
    options = linen_options(
        "linen_value_and_grad",
        num_microbatches,
        value_and_grad_kwargs,
        collections,
        has_aux,
    )
    if options.pad:
        check_accepts_example_mask(fun)
    accumulate = {  # by whether the variables hold FP8 metadata
        fp8: make_accumulated(linen_loss(fun, collections, has_aux, fp8), options)
        for fp8 in (False, True)
    }

    def accumulated(
        variables: Params,
        batch: Batch,
        *args: PyTree,
        rngs: Any = None,
        **kwargs: PyTree,
    ) -> PyTree:
        params, state, others = linen_split(variables, collections)
        fp8 = holds_metadata(params)
        return accumulate[fp8](params, state, batch, rngs, others, *args, **kwargs)

    return accumulated


def linen_loss(
    fun: Fun, collections: tuple[str, ...], has_aux: bool, fp8: bool
) -> Callable:
    """``fun`` as ``loss(params, state, batch, rngs, others, *args)``; with
    ``fp8``, ``params`` holds the ``params`` and FP8 metadata collections."""

    def loss(params, state, batch, rngs, others, *args, **kwargs):
        variables = {**others, **state, **(params if fp8 else {"params": params})}
        if rngs is not None:
            kwargs = {**kwargs, "rngs": rngs}
        out = fun(variables, batch, *args, **kwargs)
        if not collections:
            if not has_aux and looks_like_updates(out):
                raise TypeError(
                    "fun returned (out, updates), the collections apply "
                    f"updated ({sorted(out[1])}), but mutable=(). Pass the "
                    "collections model.apply mutates as mutable=[...]."
                )
            return out
        out, updates = out
        updates = flax.core.unfreeze(updates)
        if set(updates) != set(collections):
            raise ValueError(
                f"fun returned the collections {sorted(updates)}, but mutable="
                f"{list(collections)}. Pass the same collections to "
                "linen_value_and_grad's mutable and model.apply's mutable."
            )
        return out, updates

    return loss


def looks_like_updates(out: PyTree) -> bool:
    return (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[1], Mapping)
        and all(isinstance(name, str) for name in out[1])
    )


def holds_metadata(params: Params) -> bool:
    """Whether ``params`` is Flax's FP8 layout: ``params`` and its metadata."""
    return isinstance(params, dict) and OVERWRITE_WITH_GRADIENT in params


def linen_split(variables: Params, collections: tuple[str, ...]) -> tuple:
    """``variables`` as (params, mutable collections, other collections); the
    params are ``{"params": ..., "_overwrite_with_gradient": ...}`` where the
    variables hold FP8 metadata (differentiated with the parameters, as
    Flax's recipe does), else the ``"params"`` collection."""
    variables = flax.core.unfreeze(variables)
    missing = [name for name in ("params", *collections) if name not in variables]
    if missing:
        raise ValueError(
            f"variables has no collection(s) {missing}; it has "
            f"{sorted(variables)}. Pass the whole variables dict model.init "
            "returned, and name in mutable only collections it holds."
        )
    state = {name: variables[name] for name in collections}
    others = {
        name: value
        for name, value in variables.items()
        if name != "params" and name not in collections
    }
    params = variables["params"]
    if OVERWRITE_WITH_GRADIENT in others:
        params = {
            "params": params,
            OVERWRITE_WITH_GRADIENT: others.pop(OVERWRITE_WITH_GRADIENT),
        }
    return params, state, others
