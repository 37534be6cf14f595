"""The window over a named axis, as ``value_and_grad`` and ``grad`` call it:
``jax.vmap(fun, axis_name=axis_name)`` over the ``N`` micro-batches, run one
micro-batch at a time between the collectives over the axis, with the
options' reduction applied to the micro-batches' results."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._axis._collectives import Value
from jaxaccum._axis._inputs import FlatCall, batch_split, flat_call, split_keys
from jaxaccum._axis._segments import Window, run
from jaxaccum._axis._trace import Traced, trace
from jaxaccum._types import Fun, PyTree
from jaxaccum._window._accum_dtypes import sum_dtype
from jaxaccum._window._aux_plan import AuxPlan
from jaxaccum._window._call_checks import (
    check_arg_count,
    check_differentiable_args,
    check_state,
)
from jaxaccum._window._micro_result import aux_pair, checked_loss, weighted_pair
from jaxaccum._window._reduce import divide_by_total_weight
from jaxaccum._window._remat import checkpoint_policy
from jaxaccum._window._spec import WindowSpec


class _Outs(NamedTuple):
    """What ``fun`` returns for one micro-batch, as tree structures."""

    loss: Any  # the loss's structure: a scalar, or (loss_sum, weight)
    aux: Any
    state: Any


def axis_window(fun: Fun, spec: WindowSpec, plain: Fun) -> Fun:
    """``fun`` accumulated over the window as the named axis
    ``spec.axis_name``; ``plain(*args, **kwargs)`` (the window without the
    axis) where ``fun`` has no collective over it."""

    def accumulated(*args: PyTree, **kwargs: PyTree) -> PyTree:
        check_arg_count(args, spec)
        check_differentiable_args(args, spec.diff_nums)
        split = batch_split(args, spec)
        size = split.num_microbatches
        call = flat_call(args, kwargs, spec, size, split_keys(args, spec, size))
        outs: list = []
        flat = _flat_fun(fun, call, spec, outs)
        traced = trace(flat, call.examples, spec.axis_name, size)
        policy = checkpoint_policy(spec.remat)
        window = Window(spec.axis_name, size, policy, spec.unroll)
        if not any(window.is_cut(eqn) for eqn in traced.equations):
            return plain(*args, **kwargs)
        return _value_and_grad(traced, call, window, spec, outs[0], args)

    return accumulated


def _flat_fun(fun: Fun, call: FlatCall, spec: WindowSpec, outs: list) -> Callable:
    """``fun`` of the call's flat leaves for one micro-batch, returning its
    flat outputs; their structure is appended to ``outs``."""

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
        outs.append((treedef, _Outs(*[jax.tree.structure(t) for t in tree])))
        return [jnp.asarray(leaf) for leaf in leaves_out]

    return flat


def _value_and_grad(
    traced: Traced,
    call: FlatCall,
    window: Window,
    spec: WindowSpec,
    structure: tuple,
    args: tuple,
) -> PyTree:
    treedef, _ = structure
    diff_values = call.values[: call.num_diff]
    rest = call.values[call.num_diff :]
    size = window.size

    def window_loss(diff: list) -> tuple[Any, tuple]:
        inputs = dict(
            zip(traced.inputs, [*(Value(d) for d in diff), *rest], strict=True)
        )
        outputs = [value.leading(size) for value in run(traced, inputs, window)]
        loss, aux, new_state = jax.tree.unflatten(treedef, outputs)
        value = _reduced_loss(loss, spec)
        return value, (aux, new_state)

    diff = [value.array for value in diff_values]
    (value, (aux, new_state)), grads = jax.value_and_grad(window_loss, has_aux=True)(
        diff
    )
    return _package(value, aux, new_state, grads, call, spec, args, size)


def _reduced_loss(loss: Any, spec: WindowSpec) -> jax.Array:
    """The window's loss from the micro-batches' (stacked on axis 0)."""
    if spec.reduction == "weighted":
        loss_sums, weights = loss
        total = jnp.sum(loss_sums.astype(sum_dtype(loss_sums.dtype, spec.accum_dtype)))
        weight = jax.lax.stop_gradient(
            jnp.sum(weights.astype(sum_dtype(weights.dtype, spec.accum_dtype)))
        )
        return divide_by_total_weight(total, weight).astype(loss_sums.dtype)
    total = jnp.sum(loss.astype(sum_dtype(loss.dtype, spec.accum_dtype)))
    if spec.reduction == "mean":
        total = total / loss.shape[0]
    return total.astype(loss.dtype)


def _package(
    value: Any,
    aux: Any,
    new_state: tuple,
    grads: list,
    call: FlatCall,
    spec: WindowSpec,
    args: tuple,
    size: int,
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
    aux = _reduced_aux(aux, spec, size)
    result = ((value, aux), result_grads) if spec.has_aux else (value, result_grads)
    if not spec.state_nums:
        return result
    state = tuple(args[num] for num in spec.state_nums)
    new_state = jax.tree.map(_window_state, new_state)
    check_state(state, new_state, spec.state_nums)
    if isinstance(spec.state_argnums, int):
        new_state = new_state[0]
    return result, new_state


def _reduced_aux(stacked: Any, spec: WindowSpec, size: int) -> Any:
    """Aux stacked over the micro-batches, reduced as the core reduces it."""
    if not spec.has_aux:
        return ()
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    plan = AuxPlan(spec.aux_reduction, one, spec.accum_dtype)
    leaves = jax.tree.leaves(stacked)
    carry, stacks = [], []
    for leaf, reduction, dtype in zip(
        leaves, plan.reductions, plan.accum_dtypes, strict=True
    ):
        if reduction in ("stack", "concat"):
            stacks.append(leaf)
        elif reduction == "last":
            carry.append(leaf[-1])
        else:
            carry.append(jnp.sum(leaf.astype(dtype), axis=0))
    return plan.finalize(carry, stacks, size, size * _rows(one, plan))


def _rows(one: Any, plan: AuxPlan) -> int:
    """Rows of one micro-batch of a ``"concat"`` leaf (0 without one)."""
    for leaf, reduction in zip(jax.tree.leaves(one), plan.reductions, strict=True):
        if reduction == "concat":
            plan.check_concat(leaf.shape[0])
            return leaf.shape[0]
    return 0


def _window_state(stacked: jax.Array) -> jax.Array:
    """A state leaf's new value for the window from the micro-batches' (the
    window's axis first): the value they share (BatchNorm's running averages
    from pmean'd statistics), else their mean (the data-parallel rule) for
    float leaves and the last micro-batch's for the others."""
    first = stacked[0]
    if not jnp.issubdtype(stacked.dtype, jnp.inexact):
        return stacked[-1]
    same = jnp.all(stacked == first[None])
    mean = jnp.mean(stacked.astype(jnp.promote_types(stacked.dtype, jnp.float32)), 0)
    return jnp.where(same, first, mean.astype(stacked.dtype))
