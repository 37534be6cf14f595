"""The user's functions as the pipeline's loop calls them: parameters cast
back to their own dtypes, keys passed where taken, remat, and the stage's
gated backward pass (a bubble's gradient selected away, never multiplied)."""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._types import Fun, PyTree, Remat
from jaxaccum._window._accum_dtypes import accum_dtype_for, sum_dtype
from jaxaccum._window._aux_plan import AuxPlan
from jaxaccum._window._micro_result import aux_pair, checked_loss, weighted_pair
from jaxaccum._window._noise_scale import unscaled_squared_norm
from jaxaccum._window._remat import checkpoint_policy, real_only


class LossOut(NamedTuple):
    """One micro-batch's loss as the window sums it (float32 by default).

    Attributes:
      loss: its mean loss (``"mean"``), loss sum (``"sum"``, ``"weighted"``).
      weight: its weight with ``"weighted"``, else ``()``.
      aux: its aux output with ``has_aux``, else ``()``.
    """

    loss: jax.Array
    weight: PyTree
    aux: PyTree


class Calls(NamedTuple):
    """The user's functions as the window calls them, parameters arriving in
    the accumulation dtype (cast back to their own here) and keys passed as
    ``key=`` where the step has one.

    Attributes:
      embed: ``embed(params, micro_batch, key) -> x`` (rematerialised with
        ``remat``).
      stage: ``stage(stages, own, repeat, valid, probe, x, key) -> x``: the
        device's stage of ``repeat`` (its slice of ``own``, the ``stages``
        in their own dtype) on ``x``, its gradient selected away unless
        ``valid`` and accumulated in ``stages``' dtype (see
        :func:`_gated_stage`). Never saves the slice for the backward pass
        (a copy of a stage's parameters per tick); with ``remat``, saves what
        its policy says (nothing: ``True``).
      loss: ``loss(params, x, micro_batch, key) -> LossOut`` (rematerialised
        with ``remat``).
      own_stages: ``own_stages(stages)``, the stacked stage parameters cast
        to their own dtype (no gradient: ``stage`` routes it to ``stages``).
      own_loss: ``loss`` in ``loss_fn``'s own dtypes (for its shapes only).
      bare_stage: ``bare_stage(own, repeat, x, key) -> x``, the stage as
        ``stage`` runs it (its checkpoint policy, remat's) without the gate:
        the 1F1B loop takes its ``jax.vjp`` and gates the result itself.
    """

    embed: Fun
    stage: Fun
    loss: Callable[..., LossOut]
    own_stages: Callable[[Any], Any]
    own_loss: Callable[..., LossOut]
    bare_stage: Fun


def takes_key(fn: Fun | None) -> bool:
    """Whether ``fn`` takes a keyword argument ``key`` (or ``**kwargs``)."""
    if fn is None:
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function)
        return False
    return any(
        p.name == "key"
        and p.kind is not inspect.Parameter.POSITIONAL_ONLY
        or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in parameters
    )


def _keyword(fn: Fun | None, key: Any) -> dict:
    """``{"key": key}`` for a function that takes it and a key, else ``{}``."""
    return {"key": key} if key is not None and takes_key(fn) else {}


def _as_loss_out(out: PyTree, options: PipelineWindow) -> LossOut:
    """``loss_fn``'s result as a :class:`LossOut`, in its own dtypes."""
    loss, aux = aux_pair(out, "loss_fn") if options.has_aux else (out, ())
    weight: PyTree = ()
    if options.reduction == "weighted":
        loss, weight = weighted_pair(loss, "loss_fn")
        weight = jnp.asarray(weight)
    return LossOut(jnp.asarray(checked_loss(loss, "loss_fn")), weight, aux)


def summed(out: LossOut, options: PipelineWindow) -> LossOut:
    """``out`` in the dtypes the window sums it in, the core's: the loss and
    weight by :func:`sum_dtype`, aux as its :class:`AuxPlan` carries it (a
    list of leaves)."""
    plan = AuxPlan(options.aux_reduction, out.aux, options.accum_dtype)
    loss, weight = (
        jax.tree.map(lambda x: x.astype(sum_dtype(x.dtype, options.accum_dtype)), y)
        for y in (out.loss, out.weight)
    )
    return LossOut(loss, weight, plan.carry(out.aux))


# Operations that only move or retype data: their results are recomputed in
# the backward pass, never saved. The tick's slice of the device's stages
# comes out of a chain of them, and saving it would keep a copy of a stage's
# parameters per tick; in an activation's chain, their input is saved instead.
_RECOMPUTED = (
    lax.dynamic_slice_p,
    lax.slice_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.broadcast_in_dim_p,
    lax.transpose_p,
    lax.convert_element_type_p,
    lax.copy_p,
)


def _stage_policy(remat: Remat) -> Callable[..., bool]:
    """The stage's checkpoint policy: everything saveable except the data
    movement of :data:`_RECOMPUTED` (so the tick's parameters are sliced
    again in the backward pass, not saved per tick) and complex values
    (``_window._remat.real_only``); with ``remat``, only what its policy
    saves (nothing, for ``True``)."""

    @real_only
    def saveable(prim: Any, *_: PyTree, **__: Any) -> bool:
        return prim not in _RECOMPUTED

    if not remat:
        return saveable
    user = jax.checkpoint_policies.nothing_saveable if remat is True else remat

    def policy(prim: Any, *args: PyTree, **kwargs: PyTree) -> bool:
        return saveable(prim, *args, **kwargs) and user(prim, *args, **kwargs)

    return policy


def _gated_stage(stage: Fun, accum_dtype: Any) -> Fun:
    """``stage(own, repeat, x, key)`` as ``gated(accum, own, repeat, valid,
    probe, x, key)``, whose backward pass selects its cotangents away unless
    ``valid`` (a bubble's gradient is 0, even where what it computed on gives
    NaN or inf derivatives: ``0 * inf`` is not 0) and casts the parameters'
    up to ``accum``'s dtype (the gradient accumulates there across ticks).
    ``own`` is ``accum`` in the parameters' own dtype, cast once before the
    loop: no forward operation touches the parameters per tick. With a
    ``probe``, its cotangent is the squared norm of the (gated) gradient
    over the probe's value (the loss scale, or 1)."""

    @jax.custom_vjp
    def gated(accum, own, repeat, valid, probe, x, key):
        del accum, valid, probe
        return stage(own, repeat, x, key)

    def forward(accum, own, repeat, valid, probe, x, key):
        del accum
        y, pullback = jax.vjp(lambda p, x: stage(p, repeat, x, key), own, x)
        return y, (pullback, valid, probe)

    def backward(residuals, cotangent):
        pullback, valid, probe = residuals
        own_grad, x_grad = pullback(cotangent)
        grad = jax.tree.map(
            lambda g: jnp.where(
                valid, g.astype(accum_dtype_for(g.dtype, accum_dtype)), 0
            ),
            own_grad,
        )
        probe_grad = (
            None
            if probe is None
            else jnp.zeros_like(probe) + unscaled_squared_norm(grad, probe)
        )
        # Integer and bool leaves of x (labels, masks carried through the
        # stages) have float0 cotangents: nothing to select.
        x_grad = jax.tree.map(
            lambda g: g if g.dtype == jax.dtypes.float0 else jnp.where(valid, g, 0),
            x_grad,
        )
        return grad, None, None, None, probe_grad, x_grad, None

    gated.defvjp(forward, backward)
    return gated


def make_calls(
    stage_fn: Fun,
    loss_fn: Fun,
    embed_fn: Fun | None,
    options: PipelineWindow,
    like: tuple,
) -> Calls:
    """The window's :class:`Calls`; ``like`` holds ``(embed, one stage's,
    head)`` parameters in their own dtypes (what each call casts back to)."""
    embed_like, stage_like, head_like = like

    def embed(params, micro_batch, key):
        if embed_fn is None:
            return micro_batch
        params = optax.tree.cast_like(params, embed_like)
        return embed_fn(params, micro_batch, **_keyword(embed_fn, key))

    def stage(own, repeat, x, key):
        params = jax.tree.map(
            lambda p: lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False), own
        )
        return stage_fn(params, x, **_keyword(stage_fn, key))

    def own_stages(stages):
        stacked = jax.tree.map(lambda p, s: p.astype(s.dtype), stages, stage_like)
        return lax.stop_gradient(stacked)

    def own_loss(params, x, micro_batch, key):
        params = optax.tree.cast_like(params, head_like)
        out = loss_fn(params, x, micro_batch, **_keyword(loss_fn, key))
        return _as_loss_out(out, options)

    def loss(params, x, micro_batch, key):
        return summed(own_loss(params, x, micro_batch, key), options)

    bare = jax.checkpoint(stage, policy=_stage_policy(options.remat))
    if options.remat:
        policy = checkpoint_policy(options.remat)
        embed = jax.checkpoint(embed, policy=policy)
        loss = jax.checkpoint(loss, policy=policy)
    gated = _gated_stage(bare, options.accum_dtype)
    return Calls(embed, gated, loss, own_stages, own_loss, bare)
