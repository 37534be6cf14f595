"""One window: the sums of its micro-batch results, and their normalisation.

The window is the same whether it holds one micro-batch (``N == 1``, exactly
``jax.value_and_grad``) or ``N`` of them in a ``lax.scan``: its sums start at
zero, each micro-batch's :class:`MicroResult` is added, and :meth:`Window.result`
normalises them by the reduction (mean, sum, or the total weight).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._precision import _metadata
from jaxaccum._precision._loss_scale import tree_finite, unscale
from jaxaccum._types import Fun, Grads, PyTree
from jaxaccum._window._accum_dtypes import accum_dtype_for, sum_dtype, zeros_like_aval
from jaxaccum._window._aux_plan import AuxPlan
from jaxaccum._window._fsdp import shard_plan
from jaxaccum._window._micro_result import MicroResult, all_finite
from jaxaccum._window._noise_scale import (
    MicroStats,
    squared_norm,
    unscaled_squared_norm,
)
from jaxaccum._window._reduce import divide_by_total_weight
from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._split import Split


def normalized_value(options: WindowSpec, value: Any, weight: PyTree, num_means: Any):
    """The window's value from its loss sum: over ``num_means`` micro-batches
    (mean), as it is (sum), or over the total weight (weighted; 0 at 0)."""
    if options.reduction == "weighted":
        return divide_by_total_weight(value, weight)
    if options.reduction == "mean":
        return value / num_means
    return value


class Sums(NamedTuple):
    """The running sums of a window (the scan carry, state aside)."""

    value: jax.Array
    weight: PyTree
    grads: Grads
    aux: list


class Window:
    """Sums of one window's micro-batch results, and their normalisation.

    With a ``loss_scale`` (traced, the window's), each micro-batch's gradient
    comes scaled by it; the sums are unscaled once, after the last one.
    """

    def __init__(
        self,
        result_shape: MicroResult,
        options: WindowSpec,
        split: Split,
        loss_scale: jax.Array | None = None,
    ):
        self.value_shape = result_shape.value
        self.weight_shape = result_shape.out.weight
        self.grads_shape = result_shape.grads
        self.options = options
        self.split = split
        self.loss_scale = loss_scale
        self.metadata = _metadata.metadata_flags(result_shape.grads)
        self.shards = shard_plan(options, metadata=self.metadata)
        self.aux_plan = AuxPlan(
            options.aux_reduction if options.has_aux else "mean",
            result_shape.out.aux,
            options.accum_dtype,
        )
        self.aux_plan.check_concat(split.microbatch_size)
        self.aux_plan.check_per_device(options.data_axes)

    def _zeros(self, aval: Any) -> jax.Array:
        dtype = accum_dtype_for(aval.dtype, self.options.accum_dtype)
        return zeros_like_aval(aval, dtype)

    def _sum_zeros(self, aval: Any) -> jax.Array:
        return zeros_like_aval(aval, sum_dtype(aval.dtype, self.options.accum_dtype))

    def _grad_zeros(self, index: int, aval: Any) -> jax.Array:
        if self.metadata[index]:  # maxed: its identity, -inf
            return _metadata.lowest(aval)
        return self._zeros(aval)

    def _map_grads(self, fun: Fun, *trees: PyTree) -> PyTree:
        """``fun(index, *leaves)`` over gradient-shaped trees."""
        flat = [jax.tree.leaves(tree) for tree in trees]
        out = [fun(i, *leaves) for i, leaves in enumerate(zip(*flat, strict=True))]
        return jax.tree.unflatten(jax.tree.structure(self.grads_shape), out)

    def zeros(self) -> Sums:
        sums = Sums(
            self._sum_zeros(self.value_shape),
            jax.tree.map(self._sum_zeros, self.weight_shape),
            (),
            self.aux_plan.init(),
        )
        if self.shards is None:
            return sums._replace(
                grads=self._map_grads(self._grad_zeros, self.grads_shape)
            )
        # Per-device sums differ between devices: the carry is varying, except
        # gradients all-reduced per micro-batch, whose sums are the same on all.
        axes, shards = self.options.data_axes, self.shards
        sums = lax.pcast(sums, axes, to="varying")

        def grad_zeros(index: int, aval: Any) -> jax.Array:
            shape, varying = shards.accumulator(index, aval)
            zeros = self._grad_zeros(index, aval.update(shape=shape))
            return lax.pcast(zeros, axes, to="varying") if varying else zeros

        return sums._replace(grads=shards.map_leaves(grad_zeros, self.grads_shape))

    def add(self, sums: Sums, result: MicroResult) -> tuple[Sums, list]:
        """Adds one micro-batch's results; returns (sums, aux to stack)."""

        def add(total, x):
            return total + jnp.asarray(x).astype(total.dtype)

        # A weighted micro-batch was differentiated at its estimated share:
        # its loss sum's gradient is summed, the total weight divides once.
        unshare = None
        if self.options.reduction == "weighted":
            positive = result.share > 0
            unshare = jnp.where(positive, 1 / jnp.where(positive, result.share, 1), 0)

        def add_grad(index, total, grad):
            if self.metadata[index]:
                return jnp.maximum(total, _metadata.physical(grad))
            grad = jnp.asarray(grad).astype(total.dtype)
            if unshare is not None:  # in the share's dtype, which may be wider
                grad = (grad * unshare).astype(total.dtype)
            return total + grad

        aux_carry, stacked = self.aux_plan.update(sums.aux, result.out.aux)
        grads = result.grads
        if self.shards is not None:
            grads = self.shards.reduce(grads, in_window=False)
        return Sums(
            add(sums.value, result.value),
            jax.tree.map(add, sums.weight, result.out.weight),
            self._map_grads(add_grad, sums.grads, grads),
            aux_carry,
        ), stacked

    def micro_stats(
        self, result: MicroResult, example_mask: jax.Array | None
    ) -> MicroStats:
        """One micro-batch's finite flag (and, for ``report_stats``, its
        gradient's squared norm and its weight), taken inside the scan."""
        finite = all_finite(result)
        if not self.options.report_stats:
            return MicroStats(finite, (), ())
        if self.options.reduction == "weighted":
            weight = jnp.asarray(result.out.weight, jnp.float32)
        elif example_mask is not None:
            weight = jnp.sum(example_mask, dtype=jnp.float32)
        else:
            weight = jnp.float32(self.split.microbatch_size)
        # Of the loss's own gradient: the share and the loss scale divided out.
        scale = jnp.asarray(result.share, jnp.float32)
        if self.loss_scale is not None:
            scale = scale * self.loss_scale
        leaves = _metadata.gradient_leaves(result.grads)
        return MicroStats(finite, unscaled_squared_norm(leaves, scale), weight)

    def _sum_sq_norm(self, grad_sums: Any) -> jax.Array | None:
        """For ``report_stats``, the float32 squared norm of the window's
        gradient sum (reduced over devices, FP8 metadata already zeros), left
        for ``window_stats`` to normalise as it does the micro-batches' norms."""
        if not self.options.report_stats:
            return None
        if self.shards is None:
            return squared_norm(grad_sums)
        return self.shards.squared_norm(grad_sums)  # shards summed over devices

    def result(
        self, sums: Sums, stacked: list, num_active: Any = None
    ) -> "WindowResult":
        """Normalises the sums; the value, aux and grads in their own dtypes.

        ``stacked`` holds the stacked and concatenated aux leaves, each with a
        leading micro-batch axis; ``num_active`` (traced, for ``masked``) how
        many micro-batches were computed, else all were.
        """
        num_means = self.split.num_microbatches if num_active is None else num_active
        data_axes = self.options.data_axes
        if self.shards is not None:
            # Deferred reduction: each device has summed its own rows over the
            # whole window; gradients reduced per micro-batch are already.
            value, weight, aux = lax.psum(
                (sums.value, sums.weight, sums.aux), data_axes
            )
            grads = self.shards.reduce(sums.grads, in_window=True)
            sums = Sums(value, weight, grads, aux)
            num_means *= lax.axis_size(data_axes)
        metadata, sums = self._split_metadata(sums)
        finite = None
        if self.loss_scale is not None:
            grads = jax.tree.map(
                lambda total, wide: wide.astype(total.dtype),
                sums.grads,
                unscale(sums.grads, self.loss_scale),
            )
            sums = sums._replace(grads=grads)
            finite = self._finite(sums)
        grad_sq_norm = self._sum_sq_norm(sums.grads)
        value, grads = sums.value, sums.grads  # mean: each at its share already
        if grad_sq_norm is not None and self.options.reduction == "mean":
            grad_sq_norm = grad_sq_norm * jnp.square(jnp.float32(num_means))
        value = normalized_value(self.options, value, sums.weight, num_means)
        if self.options.reduction == "weighted":
            grads = divide_by_total_weight(grads, sums.weight)
        value, grads = jax.tree.map(
            lambda x, aval: x.astype(aval.dtype),
            (value, grads),
            (self.value_shape, self.grads_shape),
        )
        grads = jax.tree.unflatten(
            jax.tree.structure(grads),
            [
                grad if meta is None else meta
                for grad, meta in zip(jax.tree.leaves(grads), metadata, strict=True)
            ],
        )
        aux = self.aux_plan.finalize(
            sums.aux, stacked, num_means, self.split.batch_size
        )
        return WindowResult(value, aux, grads, grad_sq_norm, finite)

    def _split_metadata(self, sums: Sums) -> tuple[list, Sums]:
        """The FP8 metadata leaves' maxima, in their dtypes (None for the
        gradients), and the sums with zeros in their place."""
        leaves = jax.tree.leaves(sums.grads)
        avals = jax.tree.leaves(self.grads_shape)
        metadata = [
            _metadata.as_dtype(leaf, aval.dtype) if meta else None
            for leaf, aval, meta in zip(leaves, avals, self.metadata, strict=True)
        ]
        grads = [
            jnp.zeros_like(leaf) if meta else leaf
            for leaf, meta in zip(leaves, self.metadata, strict=True)
        ]
        treedef = jax.tree.structure(sums.grads)
        return metadata, sums._replace(grads=jax.tree.unflatten(treedef, grads))

    def _finite(self, sums: Sums) -> jax.Array:
        """Whether the window's sums (reduced over devices) are all finite,
        the same on every device: a gradient scattered over the data axes
        is checked shard by shard, and the flags are joined over them."""
        whole: list = [sums.value, sums.weight]
        sharded: list = []
        dims: tuple[int | None, ...] = (None,) * len(jax.tree.leaves(sums.grads))
        if self.shards is not None:
            dims = self.shards.dims
        for dim, grad in zip(dims, jax.tree.leaves(sums.grads), strict=True):
            (whole if dim is None else sharded).append(grad)
        finite = tree_finite(whole)
        if sharded:
            local = tree_finite(sharded).astype(jnp.int32)
            finite = finite & (lax.pmin(local, self.options.data_axes) > 0)
        return finite


class WindowResult(NamedTuple):
    """A window's normalised value, aux and gradients (tuples, one per
    differentiated argument); for ``report_stats`` the float32 squared norm
    of the gradient sum before normalisation (else None): see
    :func:`jaxaccum._window._noise_scale.window_stats`; with a loss scale, whether
    the window's sums are all finite (else None)."""

    value: Any
    aux: PyTree
    grads: Grads
    grad_sq_norm: jax.Array | None
    finite: jax.Array | None = None


class WindowOut(NamedTuple):
    """A window's results, before they are laid out for the caller.

    Attributes:
      result: the normalised value, aux and gradients.
      new_state: a tuple, the new value of each state argument.
      micro: the :class:`MicroStats` of every micro-batch, stacked.
    """

    result: WindowResult
    new_state: tuple
    micro: MicroStats
