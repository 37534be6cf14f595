"""A window's aux output, reduced leaf by leaf as ``aux_reduction`` says:
mean, sum, stack, concat or last."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._types import AUX_REDUCTIONS, PyTree
from jaxaccum._window._accum_dtypes import accum_dtype_for, sum_dtype, zeros_like_aval
from jaxaccum._window._spec import PER_MICROBATCH_AUX


def strided_to_batch_order(stacked: jax.Array, batch_size: int) -> jax.Array:
    """``(N, B / N, ...)`` micro-batch-major rows back to ``(B, ...)`` in batch
    order: row ``j`` of micro-batch ``k`` is example ``j N + k``."""
    rows = jnp.swapaxes(stacked, 0, 1)
    rows = rows.reshape(rows.shape[0] * rows.shape[1], *rows.shape[2:])
    return rows[:batch_size]


def contiguous_to_batch_order(stacked: jax.Array, batch_size: int) -> jax.Array:
    """``(N, B / N, ...)`` contiguous micro-batches back to ``(B, ...)``:
    row ``j`` of micro-batch ``k`` is example ``k B / N + j``."""
    rows = stacked.reshape(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:])
    return rows[:batch_size]


class AuxPlan:
    """Per-leaf aux reductions, broadcast from the user's prefix tree."""

    def __init__(self, aux_reduction: Any, aux_shape: Any, accum_dtype: Any):
        try:
            reductions = jax.tree.broadcast(aux_reduction, aux_shape)
        except ValueError as error:
            raise ValueError(
                "aux_reduction must be one of "
                f"{AUX_REDUCTIONS} or a pytree prefix of the aux output "
                f"mapping leaves to them; got {aux_reduction!r} for aux of "
                f"structure {jax.tree.structure(aux_shape)}."
            ) from error
        leaves_with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(
            aux_shape
        )
        self.paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
        self.leaves = [leaf for _, leaf in leaves_with_paths]
        self.reductions = jax.tree.leaves(reductions)
        for reduction in self.reductions:
            if reduction not in AUX_REDUCTIONS:
                raise ValueError(
                    f"Unknown aux reduction {reduction!r}; use one of {AUX_REDUCTIONS}."
                )
        self.mean_dtype = sum_dtype(jnp.float32, accum_dtype)
        self.accum_dtypes = [
            self._carry_dtype(leaf.dtype, reduction, accum_dtype)
            for leaf, reduction in zip(self.leaves, self.reductions, strict=True)
        ]

    @staticmethod
    def _carry_dtype(dtype: Any, reduction: str, accum_dtype: Any) -> Any:
        if reduction not in ("mean", "sum"):
            return dtype
        if not jnp.issubdtype(dtype, jnp.inexact):  # counted exactly
            return sum_dtype(dtype, accum_dtype)
        return accum_dtype_for(dtype, accum_dtype)

    def carry(self, aux: PyTree) -> list:
        """One micro-batch's aux leaves (every one reduced by mean or sum)
        in the dtypes their sums are carried in."""
        return [
            jnp.asarray(leaf).astype(dtype)
            for leaf, dtype in zip(jax.tree.leaves(aux), self.accum_dtypes, strict=True)
        ]

    def _stacked(self, reduction: str) -> bool:
        return reduction in ("stack", "concat")

    def check_concat(self, microbatch_size: int) -> None:
        """A ``"concat"`` leaf must hold one row per example of its micro-batch."""
        for path, leaf, reduction in zip(
            self.paths, self.leaves, self.reductions, strict=True
        ):
            if reduction == "concat" and leaf.shape[:1] != (microbatch_size,):
                raise ValueError(
                    f"aux_reduction='concat' for aux leaf {path or '(root)'} of "
                    f"shape {leaf.shape}: a concatenated leaf needs a leading "
                    f"axis of one row per example of the micro-batch "
                    f"({microbatch_size}). Use 'stack' to keep per-micro-batch "
                    "values, or 'mean' / 'sum' to reduce them."
                )

    def check_per_device(self, data_axes: tuple) -> None:
        """With data axes (each device accumulating its own rows), only
        reductions over micro-batches and devices: mean and sum.

        Raises:
          ValueError: naming the per-micro-batch reductions and what to use.
        """
        per_device = set(PER_MICROBATCH_AUX) & set(self.reductions)
        if data_axes and per_device:
            raise ValueError(
                f"aux_reduction {sorted(per_device)} is not supported when each "
                "device accumulates its own rows (shard_value_and_grad): a "
                "per-micro-batch aux value would be one device's, not the "
                "batch's. Use 'mean' (averaged over micro-batches and devices, "
                "exact for per-example means) or 'sum' for those aux leaves."
            )

    def from_stacked(self, stacked: PyTree) -> tuple[list, list]:
        """The carry and the stacked leaves :meth:`finalize` takes, from
        every micro-batch's aux at once (each leaf stacked on axis 0), as
        :meth:`update` folds them one by one."""
        carry, stacks = [], []
        for leaf, reduction, dtype in zip(
            jax.tree.leaves(stacked), self.reductions, self.accum_dtypes, strict=True
        ):
            if self._stacked(reduction):
                stacks.append(leaf)
            elif reduction == "last":
                carry.append(leaf[-1])
            else:
                carry.append(jnp.sum(leaf.astype(dtype), axis=0))
        return carry, stacks

    def init(self) -> list:
        return [
            zeros_like_aval(leaf, dtype)
            for leaf, reduction, dtype in zip(
                self.leaves, self.reductions, self.accum_dtypes, strict=True
            )
            if not self._stacked(reduction)
        ]

    def update(self, carry: list, aux: PyTree) -> tuple[list, list]:
        """Folds one micro-batch's aux into the carry; returns (carry, stacked)."""
        carried = iter(carry)
        new_carry, stacked = [], []
        for leaf, reduction, dtype in zip(
            jax.tree.leaves(aux), self.reductions, self.accum_dtypes, strict=True
        ):
            leaf = jnp.asarray(leaf)
            if self._stacked(reduction):
                stacked.append(leaf)
            elif reduction == "last":
                next(carried)
                new_carry.append(leaf)
            else:
                new_carry.append(next(carried) + leaf.astype(dtype))
        return new_carry, stacked

    def finalize(
        self,
        carry: list,
        stacked: list,
        num_means: Any,
        batch_size: int,
        batch_order: Callable[[jax.Array, int], jax.Array] = strided_to_batch_order,
    ) -> Any:
        """The aux output: ``num_means`` divides means, ``batch_size`` cuts the
        padding off concatenated leaves, ``batch_order`` puts their rows back
        in batch order (from the micro-batches' layout)."""
        carried, stacks = iter(carry), iter(stacked)
        out = []
        for leaf, reduction in zip(self.leaves, self.reductions, strict=True):
            if reduction == "stack":
                value = next(stacks)
            elif reduction == "concat":
                value = batch_order(next(stacks), batch_size)
            elif reduction == "mean":
                value = next(carried)
                if jnp.issubdtype(leaf.dtype, jnp.inexact):
                    value = (value / num_means).astype(leaf.dtype)
                else:  # an exact count's mean, in at least float32
                    value = value.astype(self.mean_dtype) / num_means
            else:
                value = next(carried)
                if reduction == "sum":
                    value = value.astype(leaf.dtype)
            out.append(value)
        return jax.tree.unflatten(self.treedef, out)
