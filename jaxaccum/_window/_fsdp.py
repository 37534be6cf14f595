"""Parameters sharded over the data axes, inside ``shard_map``: when to gather
them and when to reduce their gradients.

Under :func:`jaxaccum.shard_value_and_grad` every device holds its shard of a
parameter sharded over the data axes (FSDP, ZeRO-3): dimension ``dim`` split
``D`` ways. The loss needs the whole parameter, so it is all-gathered, either
once before the micro-batch loop (``"window"``) or inside every micro-batch
(``"microbatch"``). Each device's gradient of a micro-batch is then a whole,
local (unreduced) gradient; it is reduce-scattered over the data axes, either
every micro-batch into an accumulator of the shard's size (``"microbatch"``) or
once after the loop from a whole-size accumulator (``"window"``). Parameters
not sharded over the data axes are never gathered, and their gradients are
all-reduced (``psum``) at the time ``grad_reduce`` says. Every gradient
reduction runs in the accumulation dtype (float32 by default), whatever the
parameter's: a bfloat16 cross-device sum would round at every step of it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._types import Fun, Grads, PyTree
from jaxaccum._window._noise_scale import squared_norm
from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._split import spec_names


class ShardPlan(NamedTuple):
    """Per differentiated leaf (flattened): where it is sharded and when it
    is gathered and reduced.

    Attributes:
      data_axes: the manual mesh axes of the batch (and of FSDP shards).
      dims: the dimension sharded over ``data_axes``, or None.
      model_specs: the leaf's ``PartitionSpec`` over the other mesh axes.
      gather_in_window: gathered once before the loop (else per micro-batch);
        only meaningful where ``dims`` is not None.
      reduce_in_window: reduced once after the loop (else per micro-batch).
      gather_dtype: dtype to gather in (None: the parameter's own).
      accum_dtype: dtype gradients are reduced in (at least; None: their own).
      step: the micro-batch loop's index (inside the loop), or a constant.
      metadata: FP8 metadata (``jaxaccum._precision._metadata``): maxed over the data
        axes once per window, not summed.
    """

    data_axes: tuple[str, ...]
    dims: tuple[int | None, ...]
    model_specs: tuple[PartitionSpec, ...]
    gather_in_window: tuple[bool, ...]
    reduce_in_window: tuple[bool, ...]
    gather_dtype: Any
    accum_dtype: Any
    step: Any
    metadata: tuple[bool, ...]

    def map_leaves(self, fun: Fun, tree: PyTree) -> PyTree:
        """``fun(index, leaf)`` over the leaves of ``tree`` (the diff args'
        structure), keeping the structure."""
        leaves, treedef = jax.tree.flatten(tree)
        if len(leaves) != len(self.dims):
            raise AssertionError(f"{len(leaves)} leaves for a plan of {len(self.dims)}")
        return jax.tree.unflatten(
            treedef, [fun(index, leaf) for index, leaf in enumerate(leaves)]
        )

    def data_specs(self, diff: PyTree) -> PyTree:
        """The ``shard_map`` specs of the differentiated arguments (and of
        their gradients): the data axes on each leaf's sharded dimension."""
        axes = self.data_axes
        entry = axes[0] if len(axes) == 1 else axes

        def spec(index: int, leaf: PyTree) -> PartitionSpec:
            dim = self.dims[index]
            if dim is None:
                return PartitionSpec()
            return PartitionSpec(*(entry if i == dim else None for i in range(dim + 1)))

        return self.map_leaves(spec, diff)

    def varying(self, diff: PyTree) -> PyTree:
        """Casts the leaves not sharded over the data axes to varying.

        Differentiating an invariant input inside ``shard_map`` would psum its
        cotangent (the transpose of the implicit cast) in every micro-batch's
        backward pass, which is what deferring the reduction avoids. Shards
        vary already.
        """
        return self.map_leaves(
            lambda index, leaf: (
                lax.pcast(leaf, self.data_axes, to="varying")
                if self.dims[index] is None
                else leaf
            ),
            diff,
        )

    def gather(self, diff: PyTree, in_window: bool) -> PyTree:
        """All-gathers the sharded leaves whose gather time is ``in_window``,
        cast to ``gather_dtype`` for the transfer and back afterwards."""

        def gather_leaf(index: int, leaf: jax.Array) -> jax.Array:
            dim = self.dims[index]
            if dim is None or self.gather_in_window[index] != in_window:
                return leaf
            if not in_window:
                # Tied to the loop's step, so that XLA cannot hoist the
                # gather out of the loop and hold its result for the window.
                leaf, _ = lax.optimization_barrier((leaf, self.step))
            sent = leaf.astype(self.gather_dtype or leaf.dtype)
            whole = self._on_local_block(
                index,
                lambda x: lax.all_gather(x, self.data_axes, axis=dim, tiled=True),
                sent,
            )
            return whole.astype(leaf.dtype)

        return self.map_leaves(gather_leaf, diff)

    def _on_local_block(self, index: int, collective: Any, x: jax.Array) -> PyTree:
        """``collective(x)`` on each device's block of a leaf sharded over
        other (Auto) mesh axes too: manual over them, so that XLA does not
        first all-gather the leaf over those axes (a whole tensor-parallel
        weight) to run a collective over the data axes."""
        spec = self.model_specs[index]
        axes = {name for entry in spec for name in spec_names(entry)}
        if not axes:
            return collective(x)
        return jax.shard_map(
            collective, in_specs=spec, out_specs=spec, axis_names=axes
        )(x)

    def _reduce(self, index: int, grad: jax.Array) -> jax.Array:
        """Sums leaf ``index``'s gradient over the data axes (scattered like
        its parameter if that is sharded over them), in the accumulation dtype:
        a bfloat16 gradient is cast up before the collective, not after, so
        the cross-device sum does not round to 8 bits at each step."""
        if self.metadata[index]:
            return lax.pmax(grad, self.data_axes)
        if self.accum_dtype is not None:
            grad = grad.astype(jnp.promote_types(grad.dtype, self.accum_dtype))
        dim = self.dims[index]
        if dim is None:
            return lax.psum(grad, self.data_axes)
        return self._on_local_block(
            index,
            lambda x: lax.psum_scatter(
                x, self.data_axes, scatter_dimension=dim, tiled=True
            ),
            grad,
        )

    def reduce(self, grads: Grads, in_window: bool) -> PyTree:
        """Reduces the leaves whose reduction time is ``in_window``."""
        return self.map_leaves(
            lambda index, grad: (
                self._reduce(index, grad)
                if self.reduce_in_window[index] == in_window
                else grad
            ),
            grads,
        )

    def accumulator(self, index: int, aval: Any) -> tuple[tuple[int, ...], bool]:
        """The shape of leaf ``index``'s accumulator (a shard's when it is
        reduce-scattered per micro-batch) and whether it varies over devices
        (all but per-micro-batch all-reduced sums do)."""
        dim = self.dims[index]
        if self.reduce_in_window[index]:
            return tuple(aval.shape), True
        if dim is None:
            return tuple(aval.shape), False
        shape = list(aval.shape)
        shape[dim] //= lax.axis_size(self.data_axes)
        return tuple(shape), True

    def squared_norm(self, grads: Grads) -> jax.Array:
        """The float32 squared norm of reduced gradients (``real(x conj(x))``):
        shards' squares are summed over the data axes, whole leaves' are not."""
        sharded: list[jax.Array] = []
        whole: list[jax.Array] = []
        for dim, grad in zip(self.dims, jax.tree.leaves(grads), strict=True):
            squares = squared_norm(grad)  # complex leaves included
            (whole if dim is None else sharded).append(squares)
        total = jnp.sum(jnp.stack(whole)) if whole else jnp.float32(0)
        if sharded:
            total = total + lax.psum(jnp.sum(jnp.stack(sharded)), self.data_axes)
        return total


def shard_plan(
    options: WindowSpec, step: Any = None, metadata: tuple[bool, ...] | None = None
) -> ShardPlan | None:
    """The plan of ``options`` (None unless the window runs per device).

    ``metadata`` flags the gradient leaves that are FP8 metadata (none if not
    given); they are reduced once per window, by max, and must be replicated
    over the data axes.

    ``"auto"`` resolves per leaf: a parameter sharded over the data axes is
    gathered per micro-batch and its gradient reduce-scattered per micro-batch
    (never more than its shard held across the window, as FSDP promises);
    other gradients are all-reduced once, after the loop. ``step`` is the
    loop's index, which per-micro-batch gathers are tied to.
    """
    if not options.data_axes:
        return None
    data_axes = options.data_axes
    dims, model_specs = [], []
    sharding = options.sharding
    for spec in sharding.param_specs:
        names = [spec_names(entry) for entry in spec]
        sharded = [
            dim for dim, entry in enumerate(names) if set(entry) & set(data_axes)
        ]
        dims.append(sharded[0] if sharded else None)
        model_specs.append(
            PartitionSpec(
                *(
                    None
                    if set(entry) & set(data_axes) or not entry
                    else entry[0]
                    if len(entry) == 1
                    else entry
                    for entry in names
                )
            )
        )
    metadata = metadata or (False,) * len(dims)
    for index, (dim, meta) in enumerate(zip(dims, metadata, strict=True)):
        if meta and dim is not None:
            raise ValueError(
                f"FP8 metadata (differentiated leaf {index}, an amax history or "
                f"scale) is sharded over the data axes {data_axes} (dimension "
                f"{dim}): each device's window updates all of it, and the "
                "updates are maxed over the devices. Replicate it over the data "
                "axes (PartitionSpec() for the _overwrite_with_gradient "
                "collection)."
            )
    gather_window = sharding.param_gather == "window"
    return ShardPlan(
        data_axes=data_axes,
        dims=tuple(dims),
        model_specs=tuple(model_specs),
        gather_in_window=tuple(gather_window for _ in dims),
        reduce_in_window=tuple(
            meta
            or sharding.grad_reduce == "window"
            or (sharding.grad_reduce == "auto" and dim is None)
            for dim, meta in zip(dims, metadata, strict=True)
        ),
        gather_dtype=sharding.gather_dtype,
        accum_dtype=options.accum_dtype,
        step=jnp.zeros((), jnp.int32) if step is None else step,
        metadata=tuple(metadata),
    )
