"""``fun`` traced for one micro-batch with the window's axis bound, flattened
into one list of equations: calls (``jit``, ``checkpoint``) inlined, so that a
collective inside them is cut like one outside; a ``lax.scan`` whose body holds
one (a layer scan) unrolled, step by step; a collective over the window inside
a construct whose body cannot be cut (a while loop, a branch, a custom
derivative) refused, naming the construct."""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, NoReturn

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

# Calls whose body is inlined: their equations run as if written outside.
_INLINED = ("pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint")
# Collectives over the window that the window computes across micro-batches.
WINDOW_COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "axis_index")
# Primitives whose derivative rule JAX traces only when it differentiates.
_CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
# What a user wrote, for a construct's primitive (the refusal names it).
_CONSTRUCTS = {
    "while": "jax.lax.while_loop (or fori_loop with a traced bound)",
    "cond": "jax.lax.cond (or switch)",
    "custom_vjp_call": "a jax.custom_vjp function",
    "custom_vjp_call_jaxpr": "a jax.custom_vjp function",
    "custom_jvp_call": "a jax.custom_jvp function",
}


class Equation(NamedTuple):
    """One equation of the flattened ``fun``: its values are named by keys.

    Attributes:
      name: the primitive's name.
      bind: binds the primitive to input values, as ``eval_jaxpr`` does.
      params: the primitive's parameters (a collective's axes).
      inputs: the keys (or ``Literal`` s) of its inputs.
      outputs: the keys of its outputs (None where dropped).
      multiple: whether the primitive returns a list.
    """

    name: str
    bind: Callable[..., Any]
    params: dict
    inputs: tuple
    outputs: tuple
    multiple: bool


class Traced(NamedTuple):
    """``fun`` for one micro-batch, flattened.

    Attributes:
      equations: in order.
      inputs: the keys of the flat inputs.
      outputs: the keys (or ``Literal`` s) of the flat outputs.
      constants: the values of the traced constants, by key.
      dtypes: the dtype ``fun`` was traced with at each input, by key.
      names_axis: whether ``fun`` names the window's axis anywhere (a
        collective, or a layer scan holding one, even one of length 0).
    """

    equations: list[Equation]
    inputs: list
    outputs: list
    constants: dict
    dtypes: dict
    names_axis: bool


def as_tuple(value: Any) -> tuple:
    """A parameter that is one item or several (a tuple or a list) as a tuple."""
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def axis_names_of(params: dict) -> tuple:
    """The axis names (not positions) a primitive's parameters name (any
    hashable but an int, as ``jax.vmap``'s)."""
    names: list = []
    for field in ("axes", "axis_name"):
        values = as_tuple(params.get(field))
        names.extend(v for v in values if v is not None and not isinstance(v, int))
    return tuple(names)


def over_window(eqn: Any, axis_name: Any) -> bool:
    """Whether ``eqn`` (or an equation in a body it holds) names the axis."""
    if axis_name in axis_names_of(eqn.params):
        return True
    return any(
        over_window(inner, axis_name)
        for jaxpr in _bodies(eqn.params)
        for inner in jaxpr.eqns
    )


def _bodies(params: dict) -> list[Jaxpr]:
    found = []
    for value in params.values():
        for item in as_tuple(value):
            if isinstance(item, ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                found.append(item)
    return found


def trace(fun: Callable, examples: Sequence, axis_name: Any, size: int) -> Traced:
    """``fun`` of flat arguments like ``examples``, traced with ``axis_name``
    of ``size`` bound, flattened."""
    try:
        closed = jax.make_jaxpr(fun, axis_env=[(axis_name, size)])(*examples)
    except (ValueError, AssertionError) as error:
        _raise_if_typed(error, examples, axis_name)
        raise
    constants = {("const", i): c for i, c in enumerate(closed.consts)}
    inputs = [("in", i) for i in range(len(examples))]
    equations: list[Equation] = []
    outputs = _flatten(
        closed.jaxpr, [*constants, *inputs], (), equations, constants, axis_name
    )
    dtypes = {
        key: jax.typeof(example).dtype
        for key, example in zip(inputs, examples, strict=True)
    }
    names_axis = any(over_window(eqn, axis_name) for eqn in closed.jaxpr.eqns)
    return Traced(equations, inputs, outputs, constants, dtypes, names_axis)


def _raise_if_typed(error: Exception, examples: Sequence, axis_name: Any) -> None:
    """Inside the caller's ``shard_map`` with varying-axis types
    (``check_vma=True``, the default), whose collectives take only the mesh's
    axes (JAX fails on one over the window's axis, alone or with a device
    axis): a TypeError saying which runs work, from JAX's ``error``.

    Raises:
      TypeError: where the arguments carry varying-axis types.
    """
    varying = set().union(*(_varying(example) for example in examples))
    if not varying:
        return
    raise TypeError(
        f"fun has a collective over the window's axis {axis_name!r} inside "
        "your shard_map with varying-axis types (check_vma=True, the default, "
        f"here varying over {tuple(sorted(varying))}), whose collectives take "
        "only the mesh's axes. Run the window with "
        f"jaxaccum.shard_value_and_grad(..., axis_name={axis_name!r}), which "
        "runs its own shard_map and reduces over the devices once after the "
        "window; or pass check_vma=False to your shard_map (then reduce the "
        "gradients over the devices yourself)."
    ) from error


def _varying(example: Any) -> frozenset:
    """The mesh axes ``example``'s type says it varies over (none outside a
    ``shard_map`` with varying-axis types)."""
    manual = getattr(jax.typeof(example), "manual_axis_type", None)
    return frozenset() if manual is None else manual.varying


def _flatten(
    jaxpr: Jaxpr,
    inputs: Sequence,
    scope: tuple,
    out: list,
    constants: dict,
    axis_name: Any,
) -> list:
    """Appends ``jaxpr``'s equations to ``out``, inputs keyed ``inputs`` and
    calls inlined; returns its outputs' keys."""
    names: dict = dict(zip([*jaxpr.constvars, *jaxpr.invars], inputs, strict=True))

    def key(v: Any) -> Any:
        return v if isinstance(v, Literal) else names.setdefault(v, (scope, v))

    for number, eqn in enumerate(jaxpr.eqns):
        args = [key(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINED and over_window(eqn, axis_name):
            inner = eqn.params["jaxpr"]
            if isinstance(inner, ClosedJaxpr):
                keys = [(scope, number, "const", i) for i in range(len(inner.consts))]
                constants.update(zip(keys, inner.consts, strict=True))
                inner, args = inner.jaxpr, [*keys, *args]
            results = _flatten(inner, args, (*scope, number), out, constants, axis_name)
            for v, result in zip(eqn.outvars, results, strict=True):
                if not isinstance(v, DropVar):
                    names[v] = result
            continue
        if name == "scan" and over_window(eqn, axis_name):
            results = _unrolled_scan(
                eqn, args, (*scope, number), out, constants, axis_name
            )
            for v, result in zip(eqn.outvars, results, strict=True):
                if not isinstance(v, DropVar):
                    names[v] = result
            continue
        if name not in WINDOW_COLLECTIVES and over_window(eqn, axis_name):
            raise_unsupported(name, axis_name)
        outs = tuple(None if isinstance(v, DropVar) else key(v) for v in eqn.outvars)
        out.append(
            Equation(
                name,
                _binder(eqn),
                dict(eqn.params),
                tuple(args),
                outs,
                eqn.primitive.multiple_results,
            )
        )
    return [key(v) for v in jaxpr.outvars]


def _unrolled_scan(
    eqn: Any, args: list, scope: tuple, out: list, constants: dict, axis_name: Any
) -> list:
    """A ``lax.scan`` whose body holds a collective over the window (a layer
    scan with BatchNorm inside), unrolled into ``out``: each step's body
    flattened on its slice of ``xs``, so that each step is cut as the body
    would be written out; returns the final carry's and the stacked ``ys``'
    keys."""
    params = eqn.params
    body, num_consts, num_carry = (
        params["jaxpr"],
        params["num_consts"],
        params["num_carry"],
    )
    consts, carry, xs = (
        args[:num_consts],
        args[num_consts : num_consts + num_carry],
        args[num_consts + num_carry :],
    )
    body_keys = [(scope, "const", i) for i in range(len(body.consts))]
    constants.update(zip(body_keys, body.consts, strict=True))
    steps = range(params["length"])
    if not steps:  # the carry unchanged, each ys empty (as vmap gives them)
        return [*carry, *_empty_ys(eqn.outvars[num_carry:], scope, out)]
    ys_by_step: dict = {}
    for step in reversed(steps) if params["reverse"] else steps:
        sliced = []
        for j, x in enumerate(xs):
            key: tuple = (scope, "x", step, j)
            out.append(_synthetic("index_in_dim", _take(step), (x,), key))
            sliced.append(key)
        results = _flatten(
            body.jaxpr,
            [*body_keys, *consts, *carry, *sliced],
            (*scope, step),
            out,
            constants,
            axis_name,
        )
        carry, ys_by_step[step] = results[:num_carry], results[num_carry:]
    stacked = []
    for j in range(len(eqn.outvars) - num_carry):
        key = (scope, "y", j)
        ys = tuple(ys_by_step[step][j] for step in steps)
        out.append(_synthetic("stack", _stack, ys, key))
        stacked.append(key)
    return [*carry, *stacked]


def _empty_ys(outvars: Sequence, scope: tuple, out: list) -> list:
    """Equations in ``out`` making a length-0 scan's ``ys`` (empty arrays of
    their traced types); returns their keys."""
    keys = []
    for j, var in enumerate(outvars):
        key = (scope, "y", j)
        aval = var.aval
        empty = partial(jax.numpy.zeros, aval.shape, aval.dtype)
        out.append(_synthetic("empty", empty, (), key))
        keys.append(key)
    return keys


def _take(step: int) -> Callable[[Any], Any]:
    return lambda x: jax.lax.index_in_dim(x, step, 0, keepdims=False)


def _stack(*ys: Any) -> Any:
    return jax.numpy.stack(ys)


def _synthetic(name: str, bind: Callable, inputs: tuple, output: Any) -> Equation:
    """An equation of the unrolled scan's own (a slice of ``xs``, the stacked
    ``ys``), bound by a function."""
    return Equation(name, bind, {}, inputs, (output,), False)


def raise_unsupported(name: str, axis_name: Any) -> None:
    """A collective over the window the window cannot compute, or one inside
    a construct it cannot cut: a TypeError naming it and what to do."""
    if name in _CONSTRUCTS:
        raise TypeError(
            f"A collective over the window's axis {axis_name!r} runs inside "
            f"{_CONSTRUCTS[name]}: its body runs once per micro-batch, so a "
            "collective across micro-batches cannot be placed in it. Move the "
            "collective (BatchNorm, all_gather, psum over the axis) out of "
            "that construct, or unroll the loop in Python."
        )
    raise TypeError(
        f"{name} over the window's axis {axis_name!r} is not supported: the "
        "window computes psum, pmean, pmax, pmin, all_gather and axis_index "
        "across its micro-batches, exactly. Write the coupling with those "
        "(an all_gather and a slice by axis_index instead of a ppermute)."
    )


def raise_in_rule(error: NameError, traced: Traced, axis_name: Any) -> NoReturn:
    """Re-raises JAX's unbound-axis ``error`` from differentiating the window:
    where ``fun`` has a custom derivative and the axis is the one unbound, a
    collective over the window in its rule (a ``custom_jvp``'s jvp, a
    ``custom_vjp``'s backward), which JAX traces only when it differentiates,
    so it meets no micro-batch: a TypeError naming it.

    Raises:
      TypeError: for a collective over the window in a custom rule.
      NameError: ``error`` itself otherwise.
    """
    rules = [eqn.name for eqn in traced.equations if eqn.name in _CUSTOM_RULES]
    if not rules or f"unbound axis name: {axis_name}" not in str(error):
        raise error
    raise TypeError(
        f"A collective over the window's axis {axis_name!r} runs inside the "
        f"derivative rule of {_CONSTRUCTS[rules[0]]} (its jvp or its backward "
        "rule): JAX traces a rule only when it differentiates, one micro-batch "
        "at a time, so no collective across micro-batches can be placed in it. "
        "Compute the coupling in the primal function (outside the custom "
        "derivative), or let jax.grad differentiate it."
    ) from error


def _binder(eqn: Any) -> Callable[..., Any]:
    """``eqn``'s primitive bound as ``jax.core.eval_jaxpr`` binds it (with
    the parameters ``get_bind_params`` gives), under its context."""
    primitive, params, context = eqn.primitive, eqn.params, eqn.ctx

    def bind(*args: Any) -> Any:
        with context.manager:
            return primitive.bind(*args, **primitive.get_bind_params(params))

    return bind
