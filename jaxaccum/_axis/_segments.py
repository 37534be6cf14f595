"""The traced ``fun`` run over the window: cut at each collective over it.

The equations between two collectives over the window (a segment) run one
micro-batch at a time in a ``lax.scan`` whose body is checkpointed, so that
differentiating the window keeps, per segment, only the values that cross
its cut (stacked over the micro-batches) and recomputes the rest one
micro-batch at a time in the backward pass. An equation whose inputs are all
shared runs once, outside any scan.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from jaxaccum._axis._collectives import Value, over_window
from jaxaccum._axis._trace import WINDOW_COLLECTIVES, Equation, Traced, axis_names_of


class Window(NamedTuple):
    """The window's axis: its name, size and how its segments scan.

    Attributes:
      axis_name: the name ``fun``'s collectives use.
      size: ``N``.
      policy: ``jax.checkpoint``'s policy for each segment's body (None:
        save nothing, recompute the segment in the backward).
      unroll: ``lax.scan``'s.
      joined: whether the window joins the device axis of its name (per
        device, ``axis_name`` equal to a data axis).
    """

    axis_name: Any
    size: int
    policy: Callable | None
    unroll: int | bool
    joined: bool = False

    def is_cut(self, eqn: Equation) -> bool:
        """Whether ``eqn`` is a collective over the window (a cut)."""
        return eqn.name in WINDOW_COLLECTIVES and self.axis_name in axis_names_of(
            eqn.params
        )


def run(traced: Traced, inputs: dict, window: Window) -> list[Value]:
    """The traced ``fun``'s outputs over the window, given its inputs as
    :class:`Value` s by key."""
    env: dict = {key: Value(const) for key, const in traced.constants.items()}
    env.update(inputs)
    last_use = _last_uses(traced)
    pending: list[Equation] = []
    pending_keys: set = set()
    for index, eqn in enumerate(traced.equations):
        if window.is_cut(eqn):
            _flush(pending, pending_keys, index, env, last_use, traced, window)
            operands = [_typed(env, key, traced) for key in eqn.inputs]
            results = over_window(
                eqn.name,
                operands,
                eqn.params,
                window.axis_name,
                window.size,
                window.joined,
            )
            env.update(zip(eqn.outputs, results, strict=True))
            continue
        per_microbatch = any(
            key in pending_keys or _read(env, key).stacked
            for key in eqn.inputs
            if not isinstance(key, Literal)
        )
        if per_microbatch:
            pending.append(eqn)
            pending_keys.update(k for k in eqn.outputs if k is not None)
            continue
        args = [_cast(_read(env, key).array, key, traced) for key in eqn.inputs]
        env.update(zip(eqn.outputs, map(Value, _results(eqn, args)), strict=True))
    end = len(traced.equations)
    _flush(pending, pending_keys, end, env, last_use, traced, window)
    return [_typed(env, key, traced) for key in traced.outputs]


def _read(env: dict, key: Any) -> Value:
    return Value(key.val) if isinstance(key, Literal) else env[key]


def _typed(env: dict, key: Any, traced: Traced) -> Value:
    """A value read at the dtype ``fun`` was traced with: where it meets a
    collective or leaves ``fun``, a differentiated input is its own dtype,
    not the accumulation dtype it arrives in."""
    value = _read(env, key)
    return value._replace(array=_cast(value.array, key, traced))


def _cast(array: Any, key: Any, traced: Traced) -> Any:
    """An input read at the dtype ``fun`` was traced with (the differentiated
    arguments arrive in the accumulation dtype, so that their gradient sums
    in it across the scans)."""
    dtype = traced.dtypes.get(key) if not isinstance(key, Literal) else None
    if dtype is None or jnp.result_type(array) == dtype:
        return array
    return jnp.asarray(array).astype(dtype)


def _results(eqn: Equation, args: Sequence) -> list:
    out = eqn.bind(*args)
    return list(out) if eqn.multiple else [out]


def _last_uses(traced: Traced) -> dict:
    """Each key's last reader: an equation's index, or past the end for
    the outputs."""
    last: dict = {}
    for index, eqn in enumerate(traced.equations):
        for key in eqn.inputs:
            if not isinstance(key, Literal):
                last[key] = index
    for key in traced.outputs:
        if not isinstance(key, Literal):
            last[key] = len(traced.equations)
    return last


def _flush(
    pending: list,
    pending_keys: set,
    index: int,
    env: dict,
    last_use: dict,
    traced: Traced,
    window: Window,
) -> None:
    """Runs the pending segment as a scan over the micro-batches; its values
    read at or after equation ``index`` come out stacked into ``env``."""
    if not pending:
        return
    reads = list(
        dict.fromkeys(
            key
            for eqn in pending
            for key in eqn.inputs
            if not isinstance(key, Literal) and key not in pending_keys
        )
    )
    crossing = [k for k in pending_keys if last_use.get(k, -1) >= index]
    values = [env[key] for key in reads]
    segment = list(pending)

    def body(arrays: list, micro: jax.Array) -> list:
        local: dict = {}
        for key, value, array in zip(reads, values, arrays, strict=True):
            if value.stacked:
                array = lax.dynamic_index_in_dim(
                    array, micro, value.axis, keepdims=False
                )
            local[key] = _cast(array, key, traced)
        for eqn in segment:
            args = [k.val if isinstance(k, Literal) else local[k] for k in eqn.inputs]
            local.update(zip(eqn.outputs, _results(eqn, args), strict=True))
        return [local[key] for key in crossing]

    checkpointed = jax.checkpoint(body, policy=window.policy)
    arrays = [value.array for value in values]
    _, stacked = lax.scan(
        lambda carry, micro: (carry, checkpointed(arrays, micro)),
        None,
        jnp.arange(window.size),
        unroll=window.unroll,
    )
    for key, array in zip(crossing, stacked, strict=True):
        env[key] = Value(array, stacked=True)
    pending.clear()
    pending_keys.clear()
