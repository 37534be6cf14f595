"""A transposed convolution's kernel gradient with its operands swapped
by hand, so that it runs a fast kernel.

JAX writes the kernel gradient of an input-dilated convolution (a
transposed convolution, ``lax.conv_transpose``) as a convolution whose
window, the output's cotangent, is larger than its input. XLA swaps such a
convolution's operands itself (``ConvOperandSwapper``) and reverses the
window to do it, and no fast XLA:CPU kernel takes a reversed window: a
generic loop runs it, in the entry computation and in a loop alike (most of
a U-Net-style step). Swapped here, before XLA sees it, the reversal lands
on the small output instead: the same sums, in another order (float64
within 1e-12, tested).
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn, Var


def swaps_operands(eqn: JaxprEqn) -> bool:
    """Whether XLA would swap a convolution's operands and reverse its
    window (its window's elements outnumber its input's), and the swap is
    written here: an input-dilated, undilated-kernel, unit-stride,
    ungrouped convolution whose swapped padding is not negative, with no
    Explicit sharding on its operands."""
    params = eqn.params
    numbers = params["dimension_numbers"]
    lhs, rhs = (shape_of(v) for v in eqn.invars)
    plain = (
        ungrouped(eqn)
        and any(d > 1 for d in params["lhs_dilation"])
        and all(d == 1 for d in (*params["rhs_dilation"], *params["window_strides"]))
    )
    if not plain or explicitly_sharded(eqn):
        return False
    window = np.prod([rhs[axis] for axis in numbers.rhs_spec[2:]])
    inputs = np.prod([lhs[axis] for axis in numbers.lhs_spec[2:]])
    return bool(window > inputs) and all(
        pad >= 0 for pair in _swapped_padding(eqn) for pad in pair
    )


def ungrouped(eqn: JaxprEqn) -> bool:
    """Whether a convolution has one feature group and one batch group."""
    return eqn.params["feature_group_count"] == eqn.params["batch_group_count"] == 1


def shape_of(var: Any) -> tuple[int, ...]:
    """A jaxpr variable's shape."""
    return tuple(_aval(var).shape)


def _aval(var: Any) -> Any:
    return var.aval


def explicitly_sharded(eqn: JaxprEqn) -> bool:
    """Whether any of ``eqn``'s operands or results carries an Explicit
    sharding (a rewrite that does not permute its spec leaves it alone)."""
    return any(
        any(entry is not None for entry in getattr(_aval(v).sharding, "spec", ()))
        for v in (*eqn.invars, *eqn.outvars)
        if hasattr(_aval(v), "sharding")
    )


def _swapped_padding(eqn: JaxprEqn) -> list[tuple[int, int]]:
    """The swapped convolution's padding: the original output ``O`` long,
    read reversed (``lo' = O - 1 - lo``)."""
    params = eqn.params
    numbers = params["dimension_numbers"]
    lhs, rhs = (shape_of(v) for v in eqn.invars)
    padding = []
    for j, (lo, hi) in enumerate(params["padding"]):
        size, window = lhs[numbers.lhs_spec[2 + j]], rhs[numbers.rhs_spec[2 + j]]
        dilated = (size - 1) * params["lhs_dilation"][j] + 1
        out = dilated + lo + hi - window + 1
        padding.append((out - 1 - lo, out + dilated - 1 - window - (out - 1 - lo)))
    return padding


def swapped_conv(eqn: JaxprEqn) -> list[JaxprEqn]:
    """A convolution :func:`swaps_operands` accepts, as equations: the
    kernel (the cotangent) as the input, batch its output features; the
    input as the kernel, dilated where the input was; the canonical layout;
    the output's spatial axes reversed and put back in its layout."""
    params = eqn.params
    numbers = params["dimension_numbers"]
    rank = len(numbers.lhs_spec)
    precision = params["precision"]
    if isinstance(precision, tuple):
        precision = precision[::-1]
    back = [0] * rank  # the output's axes, read from the canonical result's
    back[numbers.out_spec[0]] = rank - 1
    back[numbers.out_spec[1]] = 0
    for j, axis in enumerate(numbers.out_spec[2:]):
        back[axis] = 1 + j

    def swapped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        rhs_spec, lhs_spec = numbers.rhs_spec, numbers.lhs_spec
        image = lax.transpose(rhs, (rhs_spec[0], *rhs_spec[2:], rhs_spec[1]))
        kernel = lax.transpose(lhs, (*lhs_spec[2:], lhs_spec[1], lhs_spec[0]))
        out = lax.conv_general_dilated(
            image,
            kernel,
            (1,) * (rank - 2),
            _swapped_padding(eqn),
            rhs_dilation=params["lhs_dilation"],
            dimension_numbers=canonical_dimension_numbers(rank),
            precision=precision,
            preferred_element_type=params["preferred_element_type"],
        )
        return lax.transpose(lax.rev(out, tuple(range(1, rank - 1))), tuple(back))

    return _inlined(eqn, swapped)


def canonical_dimension_numbers(rank: int) -> lax.ConvDimensionNumbers:
    """Batch, spatial..., feature; the kernel's spatial..., in, out: the
    layout of XLA:CPU's fast kernel."""
    spatial = tuple(range(1, rank - 1))
    return lax.ConvDimensionNumbers(
        (0, rank - 1, *spatial),
        (rank - 1, rank - 2, *range(rank - 2)),
        (0, rank - 1, *spatial),
    )


def _inlined(eqn: JaxprEqn, fun: Callable[..., jax.Array]) -> list[JaxprEqn]:
    """``fun`` traced at ``eqn``'s operand types, its equations in
    ``eqn``'s place: reading ``eqn``'s operands, writing its result."""
    types = [jax.ShapeDtypeStruct(shape_of(v), _aval(v).dtype) for v in eqn.invars]
    closed = jax.make_jaxpr(fun)(*types)
    assert not closed.consts, "the rewrite makes no constants"
    names: dict[Any, Any] = dict(zip(closed.jaxpr.invars, eqn.invars, strict=True))
    names[closed.jaxpr.outvars[0]] = eqn.outvars[0]

    def renamed(variables: Any) -> list:
        return [names.get(v, v) if isinstance(v, Var) else v for v in variables]

    return [
        inner.replace(invars=renamed(inner.invars), outvars=renamed(inner.outvars))
        for inner in closed.jaxpr.eqns
    ]
