"""The window over a named axis, as ``value_and_grad`` and ``grad`` call it:
``jax.vmap(fun, axis_name=axis_name)`` over the ``N`` micro-batches, run one
micro-batch at a time between the collectives over the axis, with the
options' reduction applied to the micro-batches' results."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._axis._collectives import Value
from jaxaccum._axis._devices import (
    check_modes,
    check_per_device,
    joins,
    window_shards,
)
from jaxaccum._axis._inputs import FlatCall, batch_split, flat_call, split_keys
from jaxaccum._axis._reduce import Total, reduced_aux, window_state
from jaxaccum._axis._segments import Window, run
from jaxaccum._axis._trace import Traced, raise_in_rule, trace
from jaxaccum._types import Fun, PyTree
from jaxaccum._window._call_checks import (
    check_arg_count,
    check_differentiable_args,
    check_state,
)
from jaxaccum._window._fsdp import ShardPlan
from jaxaccum._window._micro_result import aux_pair, checked_loss, weighted_pair
from jaxaccum._window._remat import checkpoint_policy
from jaxaccum._window._spec import WindowSpec


def axis_window(fun: Fun, spec: WindowSpec, plain: Fun) -> Fun:
    """``fun`` accumulated over the window as the named axis
    ``spec.axis_name``; ``plain(*args, **kwargs)`` (the window without the
    axis) where ``fun`` has no collective over it."""

    def accumulated(*args: PyTree, **kwargs: PyTree) -> PyTree:
        check_arg_count(args, spec)
        check_differentiable_args(args, spec.diff_nums)
        check_per_device(spec)
        split = batch_split(args, spec)
        size = split.num_microbatches
        shards = window_shards(spec)
        whole = _gathered(args, spec, shards)
        call = flat_call(whole, kwargs, spec, size, split_keys(args, spec, size))
        outs: list = []
        flat = _flat_fun(fun, call, spec, outs)
        joined = joins(spec)
        # Joined, the axis's members are the devices' micro-batches: a pmean
        # divides by D x N.
        members = size * lax.axis_size(spec.axis_name) if joined else size
        traced = trace(flat, call.examples, spec.axis_name, members)
        policy = checkpoint_policy(spec.remat)
        window = Window(spec.axis_name, size, policy, spec.unroll, joined)
        try:  # JAX traces a custom derivative's rule only when it differentiates
            if not traced.names_axis:
                return plain(*args, **kwargs)
            if shards is not None:
                check_modes(spec)
            return _value_and_grad(traced, call, window, spec, outs[0], whole, shards)
        except NameError as error:
            raise_in_rule(error, traced, spec.axis_name)

    return accumulated


def _gathered(args: tuple, spec: WindowSpec, shards: ShardPlan | None) -> tuple:
    """The call with its parameters sharded over the data axes all-gathered
    (``args`` itself without such parameters)."""
    if shards is None:
        return args
    gathered = iter(shards.gather(tuple(args[num] for num in spec.diff_nums), True))
    return tuple(
        next(gathered) if num in spec.diff_nums else arg for num, arg in enumerate(args)
    )


def _flat_fun(fun: Fun, call: FlatCall, spec: WindowSpec, outs: list) -> Callable:
    """``fun`` of the call's flat leaves for one micro-batch, returning its
    flat outputs ``(loss, aux, new_state)``; their tree structure is appended
    to ``outs``."""

    def flat(*leaves: Any) -> list:
        args, kwargs = call.rebuild(list(leaves))
        out = fun(*args, **kwargs)
        new_state: Any = ()
        if spec.state_nums:
            out, new_state = out
            if isinstance(spec.state_argnums, int):
                new_state = (new_state,)
        loss, aux = aux_pair(out, "fun") if spec.has_aux else (out, ())
        if spec.reduction == "weighted":
            loss = weighted_pair(loss, "fun")
            checked_loss(loss[0], "fun")
        else:
            loss = checked_loss(loss, "fun")
        tree = (loss, aux, tuple(new_state))
        leaves_out, treedef = jax.tree.flatten(tree)
        outs.append(treedef)
        return [jnp.asarray(leaf) for leaf in leaves_out]

    return flat


def _value_and_grad(
    traced: Traced,
    call: FlatCall,
    window: Window,
    spec: WindowSpec,
    treedef: Any,
    args: tuple,
    shards: ShardPlan | None,
) -> PyTree:
    """The window's value and gradients (aux, new state) in ``value_and_grad``'s
    layout: the traced ``fun`` run over the window, differentiated once (the
    gradients of parameters sharded over the data axes reduce-scattered by
    ``shards``)."""
    diff_values = call.values[: call.num_diff]
    rest = call.values[call.num_diff :]
    size = window.size

    def window_total(diff: list) -> tuple[Any, tuple]:
        inputs = dict(
            zip(traced.inputs, [*(Value(d) for d in diff), *rest], strict=True)
        )
        outputs = [value.leading(size) for value in run(traced, inputs, window)]
        loss, aux, new_state = jax.tree.unflatten(treedef, outputs)
        total = Total.of(loss, spec)
        return total.value, (total, aux, new_state)

    diff = [value.array for value in diff_values]
    (_, (total, aux, new_state)), grads = jax.value_and_grad(
        window_total, has_aux=True
    )(diff)
    reduce = None if shards is None else (lambda g: shards.reduce(g, True))
    value, grads = total.normalized(grads, spec.data_axes, reduce)
    aux = reduced_aux(aux, spec, size)
    return _package(value, aux, new_state, grads, call, spec, args)


def _package(
    value: Any,
    aux: Any,
    new_state: tuple,
    grads: list,
    call: FlatCall,
    spec: WindowSpec,
    args: tuple,
) -> PyTree:
    """The result in ``value_and_grad``'s layout: gradients in their
    parameters' dtypes and structure, aux reduced by ``aux_reduction``, the
    new state the window's."""
    params = [args[num] for num in spec.diff_nums]
    cast = [
        g.astype(jnp.result_type(example))
        for g, example in zip(grads, call.examples, strict=False)
    ]
    per_arg = jax.tree.unflatten(jax.tree.structure(params), cast)
    result_grads = per_arg[0] if isinstance(spec.argnums, int) else tuple(per_arg)
    result = ((value, aux), result_grads) if spec.has_aux else (value, result_grads)
    if not spec.state_nums:
        return result
    state = tuple(args[num] for num in spec.state_nums)
    new_state = jax.tree.map(window_state, new_state)
    check_state(state, new_state, spec.state_nums)
    if isinstance(spec.state_argnums, int):
        new_state = new_state[0]
    return result, new_state
