"""The window's result in the layout ``value_and_grad`` documents: the value
(and aux), the gradients, the new state and the report."""

import typing
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._precision._loss_scale import loss_scale_report
from jaxaccum._types import PyTree
from jaxaccum._window._micro_result import FiniteReport
from jaxaccum._window._noise_scale import window_stats
from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._window import WindowOut


def invalid_unless(valid: jax.Array | None, tree: PyTree) -> Any:
    """``tree`` where ``valid`` (traced) holds, else no plausible number: NaN
    in float leaves, False in bool ones (the finite flags), the dtype's most
    negative value in integer ones (its largest if unsigned)."""
    if valid is None:
        return tree

    def invalid(leaf: PyTree) -> Any:
        leaf = jnp.asarray(leaf)
        dtype = leaf.dtype
        if jnp.issubdtype(dtype, jnp.inexact):
            bad = jnp.nan
        elif jnp.issubdtype(dtype, jnp.bool_):
            bad = False
        elif jnp.issubdtype(dtype, jnp.signedinteger):
            bad = jnp.iinfo(dtype).min
        elif jnp.issubdtype(dtype, jnp.unsignedinteger):
            bad = jnp.iinfo(dtype).max
        else:  # PRNG keys: nothing to poison
            return leaf
        return jnp.where(valid, leaf, jnp.asarray(bad, dtype))

    return jax.tree.map(invalid, tree)


def package(
    out: WindowOut, options: WindowSpec, valid: Any = None, scale: Any = None
) -> PyTree:
    """The window's result in the layout ``value_and_grad`` documents;
    ``valid`` (traced, for ``masked``) false makes the value, aux, gradients
    and report invalid (see :func:`invalid_unless`), the new state aside;
    ``scale``, the call's :class:`DynamicLossScale` (with ``loss_scale``),
    makes the report a :class:`LossScaleReport`."""
    value, aux, grads, grad_sq_norm, finite = out.result
    value, aux, grads = invalid_unless(valid, (value, aux, grads))
    grads = grads[0] if isinstance(options.argnums, int) else grads
    result = ((value, aux), grads) if options.has_aux else (value, grads)
    if options.state_nums:
        new_state = out.new_state
        if isinstance(options.state_argnums, int):
            new_state = new_state[0]
        result = result, new_state
    report: Any = ()
    if options.report_stats:
        stats = window_stats(
            out.micro,
            typing.cast(jax.Array, grad_sq_norm),  # computed with report_stats
            options.reduction,
            options.data_axes,
        )
        report = invalid_unless(valid, stats)
    elif options.report_finite:
        flags = out.micro.finite
        report = invalid_unless(valid, FiniteReport(flags, jnp.all(flags)))
    if options.loss_scale:
        report = loss_scale_report(typing.cast(jax.Array, finite), scale, valid, report)
    return (result, report) if options.reports else result
