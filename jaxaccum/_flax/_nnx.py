"""Flax NNX: accumulate ``nnx.value_and_grad``, the model's other Variables
(``nnx.BatchStat``, RNG counters) carried through the micro-batches in order;
over a named axis, shared by them, each micro-batch drawing from its own split
of the RNG streams' keys."""

import dataclasses
from typing import Any

from flax import nnx
from typing_extensions import Unpack

from jaxaccum._checks import check_accepts_example_mask
from jaxaccum._types import Batch, FlaxKwargs, Fun, Params, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import WindowSpec

NNX_KEYS = (
    "an NNX model draws its randomness from its own nnx.Rngs, carried through "
    "the micro-batches with the model's state (split per micro-batch with "
    "axis_name)."
)

# Where the model's RNG keys go under a named axis: a key argument after the
# batch, split per micro-batch by the core (the caller's arguments follow).
RNG_KEYS_ARGNUM = 3


def nnx_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """``nnx.value_and_grad`` over micro-batches, the model's state carried in order.

    The model's ``wrt`` Variables are differentiated; every other Variable
    (``nnx.BatchStat``, RNG stream counters, ...) is carried through the
    micro-batches in order and written back into the model after the window,
    as ``N`` sequential training-mode forward passes leave it. With
    ``axis_name`` the window is ``jax.vmap`` over the micro-batches, which
    share that state: the RNG streams' keys are split per micro-batch
    (micro-batch ``k`` draws from ``jax.random.split(key, N)[k]``, the key
    itself for ``N = 1``), so each draws its own masks, and the counts
    advance as one forward pass advances them. Works in ``nnx.jit`` and, on
    a model merged inside the function, ``jax.jit``. What cannot be carried:
    [Flax](../guides/flax.md#nnx).

    Args:
      fun: the loss, ``fun(model, batch, *args, **kwargs)`` (``(loss, aux)``
        with ``has_aux``), which may update the model's state; ``batch`` is
        split into micro-batches, other arguments are passed unchanged.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      wrt: an ``nnx`` filter of the Variables to differentiate, as for
        ``nnx.Optimizer``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``microbatch_size``, ``reduction``, ``aux_reduction``,
        ``accum_dtype``, ``pad``, ``unroll``, ``remat``).

    Returns:
      ``accumulated(model, batch, *args, **kwargs)`` returning ``(loss,
      grads)`` (``((loss, aux), grads)`` with ``has_aux``), ``grads`` an
      ``nnx.State`` of the ``wrt`` Variables, ready for
      ``optimizer.update(model, grads)``; with ``report_finite`` or
      ``report_stats``, ``(that, report)``. The model's other state is
      updated in place.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxaccum.flax
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, x):
      ...     return jnp.mean(model(x) ** 2)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     loss, grads = jaxaccum.flax.nnx_value_and_grad(
      ...         loss_fn, num_microbatches=2)(model, x)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.arange(24.0).reshape(8, 3))
      >>> model.layers[1].mean[...].shape
      (4,)
    """
    options = WindowSpec.create(
        "nnx_value_and_grad",
        num_microbatches,
        value_and_grad_kwargs,
        FlaxKwargs,
        fixed={
            "argnums": 0,
            "batch_argnums": 2,
            "state_argnums": 1,
            "has_aux": has_aux,
        },
        refused={**SHARD_OPTIONS, "key_argnums": NNX_KEYS},
    )
    if options.pad:
        check_accepts_example_mask(fun)
    # Over a named axis the state is one value all micro-batches read: the
    # keys travel as a key argument instead, which the core splits.
    split_keys = options.axis_name is not None
    if split_keys:
        options = dataclasses.replace(options, key_argnums=RNG_KEYS_ARGNUM)

    def accumulated(
        model: Params, batch: Batch, *args: PyTree, **kwargs: PyTree
    ) -> PyTree:
        check_no_graph_nodes(args)
        micro_loss, params, state = nnx_loss(fun, model, wrt)
        if split_keys:
            keys, state = nnx.filter_state(state, nnx.RngKey, ...)
            micro_loss, args = keyed_loss(micro_loss), (keys, *args)
        out = make_accumulated(micro_loss, options)(
            params, state, batch, *args, **kwargs
        )
        out, report = out if options.reports else (out, None)
        result, new_state = out
        nnx.update(model, new_state)
        return result if report is None else (result, report)

    return accumulated


def check_no_graph_nodes(args: tuple) -> None:
    for index, arg in enumerate(args):
        if nnx.graph.is_graph_node(arg):
            raise TypeError(
                f"Argument {index + 2} is an NNX {type(arg).__name__}; only the "
                "state of the model (the first argument) is carried through the "
                "micro-batches. Make it an attribute of the model."
            )


def nnx_loss(fun: Fun, model: Params, wrt: Any) -> tuple:
    """``fun`` as ``loss(params, state, batch, *args) -> (out, new_state)``, with
    the model's ``wrt`` Variables as ``params`` and the rest as ``state``."""
    graphdef, *states = nnx.split(model, wrt, ...)
    params, state = states

    def loss(params, state, batch, *args, **kwargs):
        # copy=True: the Variables must belong to this trace to be updated.
        model = nnx.merge(graphdef, params, state, copy=True)
        out = fun(model, batch, *args, **kwargs)
        new_state = nnx.split(model, wrt, ...)[2]
        check_same_variables(state, new_state)
        return out, new_state

    return loss, params, state


def keyed_loss(loss: Fun) -> Fun:
    """``loss(params, state, batch, *args) -> (out, new_state)`` as
    ``loss(params, state, batch, keys, *args)``, the ``nnx.RngKey`` Variables
    ``keys`` out of ``state`` and ``new_state`` (NNX never changes a key:
    the model keeps its own)."""

    def keyed(
        params: Params,
        state: nnx.State,
        batch: Batch,
        keys: nnx.State,
        *args: PyTree,
        **kwargs: PyTree,
    ) -> tuple:
        out, new_state = loss(
            params, nnx.merge_state(state, keys), batch, *args, **kwargs
        )
        return out, nnx.filter_state(new_state, nnx.RngKey, ...)[1]

    return keyed


def check_same_variables(state: nnx.State, new_state: nnx.State) -> None:
    """The model after ``fun`` must hold the same non-differentiated Variables."""
    before = {path for path, _ in nnx.to_flat_state(state)}
    after = {path for path, _ in nnx.to_flat_state(new_state)}
    if before != after:
        added = ["/".join(map(str, path)) for path in sorted(after - before)]
        removed = ["/".join(map(str, path)) for path in sorted(before - after)]
        raise ValueError(
            f"fun changed which Variables the model holds (added: {added}, "
            f"removed: {removed}); the model's state is carried from one "
            "micro-batch to the next, so it must keep its Variables. nnx.pop "
            "sown intermediates inside fun and return them as aux."
        )
