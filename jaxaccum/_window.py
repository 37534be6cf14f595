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

from jaxaccum import _metadata
from jaxaccum._fsdp import shard_plan
from jaxaccum._loss_scale import tree_finite, unscale
from jaxaccum._noise_scale import MicroStats, squared_norm, unscaled_squared_norm
from jaxaccum._options import AUX_REDUCTIONS, PER_MICROBATCH_AUX, AccumOptions
from jaxaccum._reduce import divide_by_total_weight
from jaxaccum._split import Split, explicit_sharding
from jaxaccum._types import Fun, Grads, PyTree


class MicroOut(NamedTuple):
    """What one micro-batch's loss returns besides the loss (the ``has_aux``
    part of the inner ``jax.value_and_grad``).

    Attributes:
      weight: the weight of ``reduction="weighted"``, else ``()``.
      aux: the aux output of ``fun``, else ``()``.
      new_state: the new value of each ``state_argnums`` argument, a tuple.
    """

    weight: PyTree
    aux: PyTree
    new_state: tuple


class MicroResult(NamedTuple):
    """One micro-batch's loss, its other outputs and its gradients.

    Attributes:
      value: the loss as ``fun`` returned it (a loss sum where weighted).
      out: its other outputs.
      grads: the gradient of the loss at its share of the window (see
        :func:`microbatch_share`), FP8 metadata leaves their new values.
      share: the share (a float32 scalar): ``grads`` is the loss's gradient
        times ``share``.
    """

    value: Any
    out: MicroOut
    grads: Grads
    share: Any


def weighted_pair(loss: PyTree, fun: str) -> tuple[Any, Any]:
    """A weighted reduction's ``(loss_sum, weight)``, as the loss function
    (named ``fun`` in messages) must return it: a pair, the weight a scalar."""
    if not (isinstance(loss, tuple | list) and len(loss) == 2):
        raise TypeError(
            f"With reduction='weighted', {fun} must return (loss_sum, weight) "
            "(with has_aux: ((loss_sum, weight), aux)), where loss_sum sums the "
            "micro-batch's losses and weight counts (or sums the weights of) "
            f"what was summed; got {type(loss).__name__}."
        )
    if jnp.shape(loss[1]) != ():
        raise TypeError(
            f"With reduction='weighted', the weight {fun} returns must be a "
            f"scalar, got shape {jnp.shape(loss[1])}."
        )
    return loss[0], loss[1]


def aux_pair(out: PyTree, fun: str) -> tuple[Any, Any]:
    """``(loss, aux)``, as a function (named ``fun`` in messages) built with
    ``has_aux=True`` must return it: a pair."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        shape = f" of shape {jnp.shape(out)}" if hasattr(out, "shape") else ""
        raise TypeError(
            f"With has_aux=True, {fun} must return a pair (loss, aux); got a "
            f"{type(out).__name__}{shape}. Return (loss, {{}}) for no aux, or "
            "build without has_aux."
        )
    return out[0], out[1]


def microbatch_share(
    options: AccumOptions, num_means: Any, weight: PyTree, dtype: Any = jnp.float32
) -> PyTree:
    """What one micro-batch's loss is multiplied by before its backward pass,
    so that every cotangent in it is the big batch's for the same examples
    (low-precision formats, FP8's amax histories, see the big batch's ranges).

    ``num_means`` counts the window's micro-batches over every device (those
    computed, for ``masked``). Mean: ``1 / num_means``; sum: 1. Weighted: the
    share ``w_k / W`` is known only once every forward pass has run, so the
    loss sum is divided by ``num_means w_k``, the window's total if the
    micro-batches held equal weight (the big batch's cotangents exactly then,
    within the micro-batches' imbalance otherwise); zero weight, zero share.
    In ``dtype`` (float32 by default).
    """
    if options.reduction == "sum":
        return jnp.ones((), dtype)
    share = 1 / jnp.asarray(num_means, dtype)
    if options.reduction == "mean":
        return share
    weight = jnp.asarray(weight, dtype)
    safe = jnp.where(weight > 0, weight, 1)
    return lax.stop_gradient(jnp.where(weight > 0, share / safe, 0))


class FiniteReport(NamedTuple):
    """Which micro-batches of a window had a finite loss and gradient.

    Returned by :func:`value_and_grad` with ``report_finite=True``. The flags
    are taken per micro-batch inside the scan, before normalisation, so they
    name the culprit even where the window's result hides it (a window of
    zero total weight returns zeros).

    Attributes:
      microbatch_finite: bool ``(N,)``; entry ``k`` is True when micro-batch
        ``k`` (examples ``k, k + N, ...``) gave a finite loss and gradient.
      finite: bool scalar, all of them: use it to skip the update, e.g. with
        ``jax.lax.cond(report.finite, apply_update, keep, ...)``.
    """

    microbatch_finite: jax.Array
    finite: jax.Array


def all_finite(result: MicroResult) -> jax.Array:
    """Whether one micro-batch's loss and gradient are all finite."""
    leaves = [jnp.asarray(result.value), *jax.tree.leaves(result.grads)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def accum_dtype_for(dtype: Any, accum_dtype: Any) -> Any:
    """Float leaves accumulate in at least ``accum_dtype``; others as they are."""
    if accum_dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.promote_types(dtype, accum_dtype)


def sum_dtype(dtype: Any, accum_dtype: Any) -> Any:
    """The dtype a window sums a scalar in (its loss, its weights or token
    counts): integers exactly, in at least int32 (bool counts as int32);
    floats in at least float32 and ``accum_dtype``, whatever the gradients'
    dtype (a float16 sum of 160k tokens is inf)."""
    if jnp.issubdtype(dtype, jnp.bool_):
        return jnp.dtype(jnp.int32)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.int32)
    return jnp.promote_types(accum_dtype_for(dtype, accum_dtype), jnp.float32)


def normalized_value(options: AccumOptions, value: Any, weight: PyTree, num_means: Any):
    """The window's value from its loss sum: over ``num_means`` micro-batches
    (mean), as it is (sum), or over the total weight (weighted; 0 at 0)."""
    if options.reduction == "weighted":
        return divide_by_total_weight(value, weight)
    if options.reduction == "mean":
        return value / num_means
    return value


def zeros_like_aval(aval: Any, dtype: Any) -> jax.Array:
    """Zeros like ``aval``, sharded like it under an Explicit mesh.

    There a scan carry's type includes its sharding, so an accumulator must start
    sharded as the gradient it sums (e.g. a parameter sharded over a model axis).
    """
    return jnp.zeros(aval.shape, dtype, out_sharding=explicit_sharding(aval))


def _strided_to_batch_order(stacked: jax.Array, batch_size: int) -> jax.Array:
    """``(N, B / N, ...)`` micro-batch-major rows back to ``(B, ...)`` in batch
    order: row ``j`` of micro-batch ``k`` is example ``j N + k``."""
    rows = jnp.swapaxes(stacked, 0, 1)
    rows = rows.reshape(rows.shape[0] * rows.shape[1], *rows.shape[2:])
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
        self, carry: list, stacked: list, num_means: Any, batch_size: int
    ) -> Any:
        """The aux output: ``num_means`` divides means, ``batch_size`` cuts the
        padding off concatenated leaves."""
        carried, stacks = iter(carry), iter(stacked)
        out = []
        for leaf, reduction in zip(self.leaves, self.reductions, strict=True):
            if reduction == "stack":
                value = next(stacks)
            elif reduction == "concat":
                value = _strided_to_batch_order(next(stacks), batch_size)
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
        options: AccumOptions,
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
        per_device = set(PER_MICROBATCH_AUX) & set(self.aux_plan.reductions)
        if options.data_axes and per_device:
            raise ValueError(
                f"aux_reduction {sorted(per_device)} is not supported when each "
                "device accumulates its own rows (shard_value_and_grad): a "
                "per-micro-batch aux value would be one device's, not the "
                "batch's. Use 'mean' (averaged over micro-batches and devices, "
                "exact for per-example means) or 'sum' for those aux leaves."
            )

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
            return total + (grad if unshare is None else grad * unshare)

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
    :func:`jaxaccum._noise_scale.window_stats`; with a loss scale, whether
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
