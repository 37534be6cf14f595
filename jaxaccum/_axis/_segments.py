"""The traced ``fun`` run over the window: cut at each collective over it.

The equations between two collectives over the window (a segment) run one
micro-batch at a time in a ``lax.scan``, so that differentiating the window
keeps, per segment, only the values that cross its cut (stacked over the
micro-batches) and recomputes the rest one micro-batch at a time in the
backward pass: under a checkpoint policy, through ``jax.checkpoint`` of the
scan's body; without one, through the segment's own derivative, which also
reads what the segment stacked rather than recompute it. An equation whose
inputs are all shared runs once, outside any scan.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    crossing = [k for k in pending_keys if last_use.get(k, -1) >= index]
    if window.policy is None:
        _levelled(_levels(pending, set(crossing)), env, traced, window)
    else:
        _scan(list(pending), crossing, env, traced, window)
    pending.clear()
    pending_keys.clear()


def _outside_reads(segment: list) -> list:
    """The keys ``segment`` reads and does not make, in order."""
    made = {key for eqn in segment for key in eqn.outputs}
    return list(
        dict.fromkeys(
            key
            for eqn in segment
            for key in eqn.inputs
            if not isinstance(key, Literal) and key not in made
        )
    )


def _evaluate(segment: list, local: dict) -> None:
    """Runs ``segment``'s equations on the values in ``local``, into it."""
    for eqn in segment:
        args = [k.val if isinstance(k, Literal) else local[k] for k in eqn.inputs]
        local.update(zip(eqn.outputs, _results(eqn, args), strict=True))


def _inexact(array: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(array), jnp.inexact))


def _micro(
    reads: list, values: list, arrays: Sequence, micro: Any, traced: Traced | None
) -> dict:
    """The segment's reads for micro-batch ``micro`` by key (a stacked one
    indexed): at the dtype ``fun`` was traced with (:func:`_cast`), or at the
    dtype they arrive in where ``traced`` is None."""
    local = {}
    for key, value, array in zip(reads, values, arrays, strict=True):
        if value.stacked:
            array = lax.dynamic_index_in_dim(array, micro, value.axis, keepdims=False)
        local[key] = array if traced is None else _cast(array, key, traced)
    return local


def _scan(
    segment: list, crossing: list, env: dict, traced: Traced, window: Window
) -> None:
    """Runs ``segment`` as a scan over the micro-batches, its body
    checkpointed with the window's policy; ``crossing`` come out stacked
    into ``env``."""
    reads = _outside_reads(segment)
    values = [env[key] for key in reads]

    def body(arrays: list, micro: jax.Array) -> list:
        local = _micro(reads, values, arrays, micro, traced)
        _evaluate(segment, local)
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


def _levels(segment: list, crossing: set) -> list[tuple[list, list]]:
    """The segment cut after the values that cross its end (``crossing``)
    into levels: an equation that reads one made in the segment sits a level
    above its maker, so that its derivative reads the value as stacked
    rather than recompute it (a BatchNorm's statistics of a convolution's
    output, recomputed with the rest of the segment, recompute the
    convolution). Only where nothing else is read across levels (what
    crosses the end is stacked anyway); else one level. Each
    ``(equations, outputs)``: a level and the crossing values it makes (a
    level that makes none is dead and left out)."""
    made: dict = {}  # a value made in the segment: its equation's level
    levels: list[int] = []
    shared_read = False  # a value not crossing the end read at a later level
    for eqn in segment:
        inner = [k for k in eqn.inputs if not isinstance(k, Literal) and k in made]
        level = max((made[k] + (k in crossing) for k in inner), default=0)
        shared_read |= any(made[k] < level and k not in crossing for k in inner)
        levels.append(level)
        made.update((key, level) for key in eqn.outputs if key is not None)
    if shared_read:
        levels = [0] * len(segment)
    groups = []
    for level in range(max(levels, default=-1) + 1):
        eqns = [eqn for eqn, at in zip(segment, levels, strict=True) if at == level]
        outputs = [k for eqn in eqns for k in eqn.outputs if k in crossing]
        if outputs:
            groups.append((eqns, outputs))
    return groups


def _levelled(groups: list, env: dict, traced: Traced, window: Window) -> None:
    """Runs the segment's levels (:func:`_levels`) as one scan over the
    micro-batches, their crossing values stacked into ``env``, with its own
    derivative: one scan too, each micro-batch's levels backwards, a level's
    reads from the levels below it taken from the stacked outputs, their
    cotangents summed for the micro-batch before the level below reads them.
    Nothing else is kept: the rest is recomputed, as ``jax.checkpoint``
    without a policy would."""
    segment = [eqn for eqns, _ in groups for eqn in eqns]
    outputs = [key for _, made in groups for key in made]
    reads = _outside_reads(segment)
    values = [env[key] for key in reads]

    def forward(arrays: list) -> list:
        def body(carry: None, micro: jax.Array) -> tuple:
            local = _micro(reads, values, arrays, micro, traced)
            _evaluate(segment, local)
            return carry, [local[key] for key in outputs]

        steps = jnp.arange(window.size)
        return lax.scan(body, None, steps, unroll=window.unroll)[1]

    def backward(residuals: tuple, cts: list) -> tuple:
        arrays, stacked = residuals
        made = dict(zip(outputs, stacked, strict=True))
        context = (groups, reads, values, traced, window)
        return (_levelled_backward(context, arrays, made, cts),)

    def forward_saving(arrays: list) -> tuple:
        stacked = forward(arrays)
        return stacked, (arrays, stacked)

    levelled = jax.custom_vjp(forward)
    levelled.defvjp(forward_saving, backward)
    for key, array in zip(outputs, levelled([v.array for v in values]), strict=True):
        env[key] = Value(array, stacked=True)


def _levelled_backward(
    context: tuple, arrays: list, stacked: dict, cotangents: list
) -> list:
    """The cotangents of a levelled segment's reads (None for an integer
    one): a scan over the micro-batches, a stacked read's written into its
    micro-batch's slot, a shared read's summed."""
    groups, reads, values, traced, window = context
    cts = dict(zip(stacked, cotangents, strict=True))
    diff = [_inexact(array) for array in arrays]
    # Every slot of a stacked read's cotangent is written, so its buffer may
    # start as anything: a value of the incoming cotangents, not zeros, so
    # that XLA makes it when the backward pass starts, not with the forward.
    # (Zeros where the cotangents carry an Explicit sharding: their element
    # would need a reshard.)
    seed = next((c.ravel()[0] for c in cts.values() if _seeds(c)), 0)
    start = [
        jnp.full_like(a, jnp.real(seed).astype(a.dtype))
        if v.stacked
        else jnp.zeros_like(a)
        for a, v, d in zip(arrays, values, diff, strict=True)
        if d
    ]
    pairs = [(k, v) for k, v, d in zip(reads, values, diff, strict=True) if d]

    def body(acc: list, micro: jax.Array) -> tuple:
        local = _micro(reads, values, arrays, micro, None)
        made = {
            k: lax.dynamic_index_in_dim(s, micro, 0, False) for k, s in stacked.items()
        }
        ct = {
            k: lax.dynamic_index_in_dim(c, micro, 0, False)
            for k, c in cts.items()
            if _inexact(c)
        }
        for eqns, outs in reversed(groups):
            _level_vjp(eqns, outs, local, made, ct, traced)
        out = []
        for (key, value), array in zip(pairs, acc, strict=True):
            got = ct.get(key, jnp.zeros_like(local[key])).astype(array.dtype)
            if value.stacked:
                out.append(
                    lax.dynamic_update_index_in_dim(array, got, micro, value.axis)
                )
            else:
                out.append(array + got)
        return out, None

    steps = jnp.arange(window.size)
    acc = iter(lax.scan(body, start, steps, unroll=window.unroll, reverse=True)[0])
    return [next(acc) if d else None for d in diff]


def _seeds(array: Any) -> bool:
    """Whether ``array`` is a nonempty float array without an Explicit
    sharding (its first element can seed an accumulator)."""
    spec = getattr(getattr(jax.typeof(array), "sharding", None), "spec", ())
    unsharded = all(entry is None for entry in spec)
    return bool(array.size) and _inexact(array) and unsharded


def _level_vjp(
    eqns: list, outs: list, local: dict, made: dict, ct: dict, traced: Traced
) -> None:
    """One level's derivative for one micro-batch: the cotangents of its
    outputs (in ``ct``) pulled back onto what it reads (a read of the
    segment at the dtype it arrived in, or a lower level's value from
    ``made``), summed into ``ct``."""
    ins = _outside_reads(eqns)
    primal = [local[k] if k in local else made[k] for k in ins]
    wrt = [i for i, value in enumerate(primal) if _inexact(value)]

    def level(*diffed: Any) -> list:
        vals = dict(zip(ins, primal, strict=True))
        vals.update((ins[i], value) for i, value in zip(wrt, diffed, strict=True))
        inner = {k: _cast(v, k, traced) if k in local else v for k, v in vals.items()}
        _evaluate(eqns, inner)
        return [inner[k] for k in outs]

    _, pull = jax.vjp(level, *(primal[i] for i in wrt))
    out_cts = [
        ct[k] if k in ct else np.zeros(jnp.shape(made[k]), jax.dtypes.float0)
        for k in outs
    ]
    for i, got in zip(wrt, pull(out_cts), strict=True):
        ct[ins[i]] = ct[ins[i]] + got if ins[i] in ct else got
