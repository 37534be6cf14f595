"""A stage's backward split in two at its jaxpr: the input part B (what
the stage input's cotangent needs) and the weight part W (the rest of what
the parameters' cotangent needs), so that W does not redo the cotangents
flowing back through the stage's layers (a pullback whose input cotangent
is merely dropped recomputes them: ``2 L - 1`` layers' backward for ``L``).

B runs the equations its outputs need and returns, besides the input's
cotangent, the boundary: the values it computed (and the cotangents it was
handed) that W's equations read; W runs the equations only the parameters'
cotangent needs, from the boundary and the saved residuals. Calls inside
the backward (``jit``, ``jax.checkpoint``) are inlined first, so a
rematerialised stage splits too (each half recomputing what it needs); every
other equation (a ``custom_jvp_call`` such as ``jax.nn.softplus`` in a
recomputed forward, a ``custom_vjp_call``, a loop) is re-bound whole, as
``jax.core.eval_jaxpr`` binds it."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

_INLINED = ("remat2", "checkpoint", "pjit", "jit", "closed_call")


class _Eqn(NamedTuple):
    """One equation of the flattened backward: keys name its values."""

    bind: Callable[..., Any]
    multiple: bool
    inputs: tuple
    outputs: tuple


class SplitBackward(NamedTuple):
    """A backward ``f(*inputs) -> (*weights, *inputs_cotangent)`` split.

    Attributes:
      eqns: the flattened equations, in order.
      inputs: the keys of ``f``'s flat inputs.
      weights: the keys (or literal values) of the weight outputs.
      cotangents: those of the input-cotangent outputs.
      input_part: the indices of B's equations.
      weight_part: the indices of W's equations (none of B's).
      boundary: the keys W reads that B computed or was handed.
      constants: values of the keys of inlined calls' constants.
    """

    eqns: tuple
    inputs: tuple
    weights: tuple
    cotangents: tuple
    input_part: tuple
    weight_part: tuple
    boundary: tuple
    constants: dict


def _flatten(jaxpr: Jaxpr, inputs: Sequence, scope: tuple, out: list, consts: dict):
    """Appends ``jaxpr``'s equations to ``out`` with its inputs keyed
    ``inputs`` and calls inlined; returns its outputs' keys."""
    names: dict = dict(zip([*jaxpr.constvars, *jaxpr.invars], inputs, strict=True))

    def key(v: Any) -> Any:
        if isinstance(v, Literal):
            return v
        return names.setdefault(v, (scope, v))

    for number, eqn in enumerate(jaxpr.eqns):
        args = [key(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
        if inner is not None:
            if isinstance(inner, ClosedJaxpr):
                const_keys = [
                    (scope, number, "const", i) for i in range(len(inner.consts))
                ]
                consts.update(zip(const_keys, inner.consts, strict=True))
                inner, args = inner.jaxpr, [*const_keys, *args]
            results = _flatten(inner, args, (*scope, number), out, consts)
            for v, result in zip(eqn.outvars, results, strict=True):
                if not isinstance(v, DropVar):
                    names[v] = result
            continue
        outs = tuple(None if isinstance(v, DropVar) else key(v) for v in eqn.outvars)
        bind = _binder(eqn)
        out.append(_Eqn(bind, eqn.primitive.multiple_results, tuple(args), outs))
    return [key(v) for v in jaxpr.outvars]


def _binder(eqn: Any) -> Callable[..., Any]:
    """``eqn``'s primitive bound as ``jax.core.eval_jaxpr`` binds it: with
    the parameters its ``get_bind_params`` gives (a ``custom_jvp_call`` or
    ``custom_vjp_call`` takes its functions as ``subfuns``, not its stored
    jaxprs and thunks) under the equation's context."""
    primitive, params, context = eqn.primitive, eqn.params, eqn.ctx

    def bind(*args: Any) -> Any:
        with context.manager:
            return primitive.bind(*args, **primitive.get_bind_params(params))

    return bind


def _needed(eqns: Sequence[_Eqn], wanted: Sequence) -> set[int]:
    """The indices of the equations ``wanted`` depends on."""
    need = {k for k in wanted if not isinstance(k, Literal)}
    chosen = set()
    for index in reversed(range(len(eqns))):
        if any(k in need for k in eqns[index].outputs if k is not None):
            chosen.add(index)
            need.update(k for k in eqns[index].inputs if not isinstance(k, Literal))
    return chosen


def split_backward(
    fun: Callable[..., Any], args: Sequence, num_cotangents: int, handed: int
) -> SplitBackward:
    """``fun(*args)``'s flat outputs (its last ``num_cotangents`` the input
    cotangent, the others the weights') split into B and W; the last
    ``handed`` of ``args`` are the cotangents B is handed (W gets from B
    those it reads)."""
    closed = jax.make_jaxpr(fun)(*args)
    eqns: list[_Eqn] = []
    inputs = [("in", i) for i in range(len(closed.jaxpr.invars))]
    consts = {("const", i): c for i, c in enumerate(closed.consts)}
    keys = [*consts, *inputs]
    outs = _flatten(closed.jaxpr, keys, ("top",), eqns, consts)
    split = len(outs) - num_cotangents
    weights, cotangents = outs[:split], outs[split:]
    input_part = _needed(eqns, cotangents)
    weight_part = _needed(eqns, weights) - input_part
    computed = {k for i in input_part for k in eqns[i].outputs if k is not None}
    computed |= set(inputs[len(inputs) - handed :])
    read = [k for i in sorted(weight_part) for k in eqns[i].inputs]
    read += list(weights)
    boundary = tuple(dict.fromkeys(k for k in read if _hashable(k) and k in computed))
    return SplitBackward(
        tuple(eqns),
        tuple(inputs),
        tuple(weights),
        tuple(cotangents),
        tuple(sorted(input_part)),
        tuple(sorted(weight_part)),
        boundary,
        consts,
    )


def _hashable(key: Any) -> bool:
    return not isinstance(key, Literal)


def _run(split: SplitBackward, part: tuple, values: dict) -> dict:
    def read(k: Any) -> Any:
        return k.val if isinstance(k, Literal) else values[k]

    for index in part:
        eqn = split.eqns[index]
        results = eqn.bind(*[read(k) for k in eqn.inputs])
        results = results if eqn.multiple else [results]
        for k, value in zip(eqn.outputs, results, strict=True):
            if k is not None:
                values[k] = value
    return values


def _read(values: dict, keys: Sequence) -> list:
    return [k.val if isinstance(k, Literal) else values[k] for k in keys]


def input_part(split: SplitBackward, args: Sequence) -> tuple[list, list]:
    """B: the input cotangent's flat leaves and the boundary's values."""
    values = {**split.constants, **dict(zip(split.inputs, args, strict=True))}
    values = _run(split, split.input_part, values)
    return _read(values, split.cotangents), _read(values, split.boundary)


def weight_part(split: SplitBackward, args: Sequence, boundary: Sequence) -> list:
    """W: the weights' flat cotangent leaves, from ``args`` (the handed
    cotangents among them are not read) and B's ``boundary``."""
    values = {**split.constants, **dict(zip(split.inputs, args, strict=True))}
    values.update(zip(split.boundary, boundary, strict=True))
    values = _run(split, split.weight_part, values)
    return _read(values, split.weights)
