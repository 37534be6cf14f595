"""The window's results over a named axis, from the micro-batches' (stacked
on axis 0): the loss's total and what it is divided by, the aux output, the
new state."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._window._accum_dtypes import sum_dtype
from jaxaccum._window._aux_plan import (
    AuxPlan,
    contiguous_to_batch_order,
    strided_to_batch_order,
)
from jaxaccum._window._reduce import divide_by_total_weight
from jaxaccum._window._spec import WindowSpec


class Total(NamedTuple):
    """The window's loss as a total and a count: the value is
    ``total / count`` (``total`` for a sum), and so is the gradient, the
    total's gradient divided by the count.

    Attributes:
      value: the total, differentiated: the micro-batches' losses (loss sums,
        weighted) summed in at least float32.
      count: what the total is divided by: ``N`` for a mean, the summed
        weights (not differentiated) for a weighted loss, None for a sum.
      dtype: the loss's dtype, the value's.
    """

    value: jax.Array
    count: Any
    dtype: Any

    @classmethod
    def of(cls, loss: Any, spec: WindowSpec) -> "Total":
        if spec.reduction == "weighted":
            sums, weights = loss
            total = jnp.sum(sums.astype(sum_dtype(sums.dtype, spec.accum_dtype)))
            weight = jnp.sum(weights.astype(sum_dtype(weights.dtype, spec.accum_dtype)))
            return cls(total, lax.stop_gradient(weight), sums.dtype)
        total = jnp.sum(loss.astype(sum_dtype(loss.dtype, spec.accum_dtype)))
        count = (
            jnp.asarray(loss.shape[0], total.dtype)
            if spec.reduction == "mean"
            else None
        )
        return cls(total, count, loss.dtype)

    def normalized(
        self,
        grads: Any,
        data_axes: tuple,
        reduce: Callable[[Any], Any] | None = None,
    ) -> tuple[jax.Array, Any]:
        """The value and the gradients: per device, each device's total and
        gradient summed over ``data_axes`` once (the gradients by ``reduce``
        where given: FSDP's reduce-scatter); then divided by the count (zeros
        where a weighted window weighs nothing)."""
        total, count = self.value, self.count
        if data_axes:
            if reduce is None:  # one all-reduce of the total and the gradients
                total, grads = lax.psum((total, grads), data_axes)
            else:
                total, grads = lax.psum(total, data_axes), reduce(grads)
            count = None if count is None else lax.psum(count, data_axes)
        if count is None:
            return total.astype(self.dtype), grads
        value, grads = divide_by_total_weight((total, grads), count)
        return value.astype(self.dtype), grads


def reduced_aux(stacked: Any, spec: WindowSpec, size: int) -> Any:
    """Aux stacked over the micro-batches, reduced as the core reduces it:
    per device, the means' and sums' carries summed over the devices before
    they are finalized (per-micro-batch reductions refused there)."""
    if not spec.has_aux:
        return ()
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    plan = AuxPlan(spec.aux_reduction, one, spec.accum_dtype)
    plan.check_per_device(spec.data_axes)
    carry, stacks = plan.from_stacked(stacked)
    num_means: Any = size
    if spec.data_axes:
        carry = lax.psum(carry, spec.data_axes)
        num_means = size * lax.axis_size(spec.data_axes)
    order = (
        strided_to_batch_order
        if spec.axis_layout == "strided"
        else contiguous_to_batch_order
    )
    return plan.finalize(carry, stacks, num_means, size * _rows(one, plan), order)


def _rows(one: Any, plan: AuxPlan) -> int:
    """Rows of one micro-batch of a ``"concat"`` leaf (0 without one)."""
    for leaf, reduction in zip(jax.tree.leaves(one), plan.reductions, strict=True):
        if reduction == "concat":
            plan.check_concat(leaf.shape[0])
            return leaf.shape[0]
    return 0


def window_state(stacked: jax.Array) -> jax.Array:
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
