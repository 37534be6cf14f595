"""Convolutions inside the window's loops in the layout of the backend's
fast kernel.

XLA:CPU rewrites a convolution into the layout its fast kernel takes (batch,
spatial, feature; the kernel's spatial, input, output: ``b01f_01io->b01f``)
in the entry computation, but not inside a while loop's body. There the
kernel gradient's convolution, which JAX's transpose rule writes as
``f01b_i01o->01bf``, runs a generic kernel: 6 to 19 times the full batch's
time for a convolutional model. The window's program is therefore rewritten
after it is traced (so after differentiation): each convolution inside a
loop's body becomes the same convolution in the canonical layout between
explicit transposes; where the window covers the whole input (a 1x1
convolution's kernel gradient), a dot over the contracted axes, which needs
at most one of the transposed copies; where XLA would swap the operands
and reverse the window (a transposed convolution's kernel gradient), the
swap written first (``_conv_swap``). Each kernel gradient's transposed
input waits for its cotangent (``_conv_order``), so that it is made in the
backward pass, not held through the forward one. The result is the
untouched program's up to the order of its sums (float64 within 1e-12,
tested).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var, jaxpr_as_fun
from jax.sharding import PartitionSpec

from jaxaccum._types import ConvLayout, Fun, PyTree
from jaxaccum._window._conv_order import ordered
from jaxaccum._window._conv_swap import (
    canonical_dimension_numbers,
    explicitly_sharded,
    shape_of,
    swapped_conv,
    swaps_operands,
    ungrouped,
)

# Primitives whose bodies run once per iteration: their convolutions are
# the ones XLA:CPU leaves in the slow layout.
_LOOPS = ("scan", "while")


def rewrites_convs(layout: ConvLayout) -> bool:
    """Whether ``layout`` rewrites the window's convolutions here: always for
    ``"canonical"``, on CPU for ``"auto"`` (where it was measured to pay),
    never for ``"traced"``."""
    if layout == "auto":
        return jax.default_backend() == "cpu"
    return layout == "canonical"


def with_canonical_convs(fun: Fun) -> Fun:
    """``fun``, its program's convolutions inside loops in the canonical
    layout: ``fun`` traced once at its array arguments (the others, such as
    ``train=True``, passed as they are), rewritten, and evaluated."""

    @functools.wraps(fun)
    def rewritten(*args: PyTree, **kwargs: PyTree) -> PyTree:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def flat(*values: Any) -> Any:
            call = list(leaves)
            for position, value in zip(arrays, values, strict=True):
                call[position] = value
            call_args, call_kwargs = jax.tree.unflatten(treedef, call)
            return fun(*call_args, **call_kwargs)

        values = [leaves[i] for i in arrays]
        closed, shapes = jax.make_jaxpr(flat, return_shape=True)(*values)
        program = ClosedJaxpr(canonical_jaxpr(closed.jaxpr), closed.consts)
        outputs = jaxpr_as_fun(program)(*values)
        return jax.tree.unflatten(jax.tree.structure(shapes), outputs)

    return rewritten


def _is_array(leaf: Any) -> bool:
    """Traced: JAX and NumPy arrays; anything else (a Python or NumPy scalar
    such as a count, an option) is passed as it is."""
    return isinstance(leaf, jax.Array | np.ndarray)


def canonical_jaxpr(jaxpr: Jaxpr, in_loop: bool = False) -> Jaxpr:
    """``jaxpr`` with each convolution inside a loop's body (``in_loop``:
    ``jaxpr`` is one) in the canonical layout, nested bodies included."""
    eqns: list[JaxprEqn] = []
    for eqn in ordered(jaxpr.eqns) if in_loop else jaxpr.eqns:
        if in_loop and eqn.primitive is lax.conv_general_dilated_p:
            eqns.extend(canonical_conv(eqn))
            continue
        inner = in_loop or eqn.primitive.name in _LOOPS
        params = {
            name: _rewritten_param(value, inner) for name, value in eqn.params.items()
        }
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def _rewritten_param(value: Any, in_loop: bool) -> Any:
    if isinstance(value, ClosedJaxpr):
        return ClosedJaxpr(canonical_jaxpr(value.jaxpr, in_loop), value.consts)
    if isinstance(value, Jaxpr):
        return canonical_jaxpr(value, in_loop)
    if isinstance(value, tuple) and any(
        isinstance(item, ClosedJaxpr | Jaxpr) for item in value
    ):
        return tuple(_rewritten_param(item, in_loop) for item in value)
    return value


def canonical_conv(eqn: JaxprEqn) -> list[JaxprEqn]:
    """A convolution's equation as equations that transpose its operands to
    the canonical layout, convolve there and transpose the result back (the
    equation itself where it is canonical already)."""
    if swaps_operands(eqn):
        return swapped_conv(eqn)
    numbers = eqn.params["dimension_numbers"]
    canonical = canonical_dimension_numbers(len(numbers.lhs_spec))
    if numbers == canonical:
        return [eqn]
    if _is_contraction(eqn):
        return _as_dot(eqn)
    lhs_order = (numbers.lhs_spec[0], *numbers.lhs_spec[2:], numbers.lhs_spec[1])
    rhs_order = (*numbers.rhs_spec[2:], numbers.rhs_spec[1], numbers.rhs_spec[0])
    out_order = (numbers.out_spec[0], *numbers.out_spec[2:], numbers.out_spec[1])
    lhs, lhs_eqn = _transposed(eqn, eqn.invars[0], lhs_order)
    rhs, rhs_eqn = _transposed(eqn, eqn.invars[1], rhs_order)
    (out,) = eqn.outvars
    result = _permuted_var(out, out_order)
    conv = eqn.replace(
        params={**eqn.params, "dimension_numbers": canonical},
        invars=[lhs, rhs],
        outvars=[result],
    )
    back = _transpose_eqn(eqn, result, out, tuple(np.argsort(out_order).tolist()))
    return [lhs_eqn, rhs_eqn, conv, back]


def _is_contraction(eqn: JaxprEqn) -> bool:
    """Whether a convolution is a plain contraction: its window covers its
    whole unpadded, undilated input (a 1x1 convolution's kernel gradient),
    so each output is a dot of the operands over spatial and feature axes.
    Only where no operand carries an Explicit sharding."""
    params = eqn.params
    numbers = params["dimension_numbers"]
    lhs, rhs = (shape_of(v) for v in eqn.invars)
    plain = (
        ungrouped(eqn)
        and all(p == (0, 0) for p in params["padding"])
        and all(d == 1 for d in (*params["lhs_dilation"], *params["rhs_dilation"]))
    )
    spatial_lhs = [lhs[axis] for axis in numbers.lhs_spec[2:]]
    spatial_rhs = [rhs[axis] for axis in numbers.rhs_spec[2:]]
    return plain and spatial_lhs == spatial_rhs and not explicitly_sharded(eqn)


def _as_dot(eqn: JaxprEqn) -> list[JaxprEqn]:
    """A contraction's convolution (:func:`_is_contraction`) as a
    ``dot_general`` over the spatial and feature axes, its (kernel-sized)
    product put into the output's layout. XLA:CPU lays a dot's first operand
    out with the contracted axes last: the smaller operand goes first, so
    at most it is copied, where the canonical convolution copies both."""
    numbers = eqn.params["dimension_numbers"]
    # The contracted pairs in the lhs's axis order: where both operands hold
    # them in one order (batch, spatial... as the kernel gradient's do) XLA
    # contracts them as one axis.
    pairs = sorted(
        zip(
            (*numbers.lhs_spec[2:], numbers.lhs_spec[1]),
            (*numbers.rhs_spec[2:], numbers.rhs_spec[1]),
            strict=True,
        )
    )
    lhs_axes, rhs_axes = (tuple(axes) for axes in zip(*pairs, strict=True))
    (out,) = eqn.outvars
    lhs, rhs = eqn.invars
    precision = eqn.params["precision"]
    # The product's axes: (lhs batch, rhs out) or, swapped, the reverse.
    kept = [numbers.out_spec[0], numbers.out_spec[1]]
    if np.prod(shape_of(rhs)) < np.prod(shape_of(lhs)):
        lhs, rhs, lhs_axes, rhs_axes = rhs, lhs, rhs_axes, lhs_axes
        kept.reverse()
        if isinstance(precision, tuple):
            precision = precision[::-1]
    product = Var(out.aval.update(shape=tuple(shape_of(out)[a] for a in kept)))
    dot = eqn.replace(
        primitive=lax.dot_general_p,
        params={
            "dimension_numbers": ((lhs_axes, rhs_axes), ((), ())),
            "precision": precision,
            "preferred_element_type": eqn.params["preferred_element_type"],
            "out_sharding": None,
        },
        invars=[lhs, rhs],
        outvars=[product],
    )
    eqns = [dot]
    if kept[0] > kept[1]:
        product, swapped = (
            Var(product.aval.update(shape=shape_of(product)[::-1])),
            product,
        )
        eqns.append(_transpose_eqn(eqn, swapped, product, (1, 0)))
    spread = eqn.replace(
        primitive=lax.broadcast_in_dim_p,
        params={
            "shape": shape_of(out),
            "broadcast_dimensions": tuple(sorted(kept)),
            "sharding": None,
        },
        invars=[product],
        outvars=[out],
    )
    return [*eqns, spread]


def _permuted_var(var: Any, order: Sequence[int]) -> Var:
    """A new variable of ``var``'s type with its axes in ``order`` (an
    Explicit sharding's spec permuted with them)."""
    aval = var.aval
    changes: dict[str, Any] = {"shape": tuple(aval.shape[axis] for axis in order)}
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is not None and spec is not None and any(e is not None for e in spec):
        padded = (*spec, *(None,) * (len(aval.shape) - len(spec)))
        permuted = PartitionSpec(*(padded[axis] for axis in order))
        changes["sharding"] = sharding.update(spec=permuted)
    return Var(aval.update(**changes))


def _transposed(eqn: JaxprEqn, var: Any, order: Sequence[int]) -> tuple[Var, JaxprEqn]:
    out = _permuted_var(var, order)
    return out, _transpose_eqn(eqn, var, out, tuple(order))


def _transpose_eqn(eqn: JaxprEqn, source: Any, out: Var, order: tuple) -> JaxprEqn:
    """``out = transpose(source, order)``, in ``eqn``'s context."""
    return eqn.replace(
        primitive=lax.transpose_p,
        params={"permutation": order},
        invars=[source],
        outvars=[out],
    )


def window_kernels(fun: Fun, layout: ConvLayout) -> Callable[..., PyTree]:
    """``fun`` with its loops' convolutions canonical where ``layout`` says
    so here (:func:`rewrites_convs`), else ``fun`` itself."""
    return with_canonical_convs(fun) if rewrites_convs(layout) else fun
