"""The cached window per device (``mesh=``, ``data_axis=``): each device runs
both passes over its own rows under ``shard_map``; the encoder's outputs are
gathered once for the loss, each device takes back its rows of the loss's
cotangent (a slice, no collective), and one reduction after pass 2 sums the
devices' gradients. Nothing collective runs inside either pass's loop."""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._cached._library import (
    WindowSpec,
    call_mesh,
    check_arg_count,
    data_axes_of,
    explicit_sharding,
    fold_device_index,
    per_device_options,
    resolve_mesh,
    rows_over_devices,
    run_per_device,
    spec_names,
)
from jaxaccum._cached._loss import LossGrad
from jaxaccum._cached._roles import placed
from jaxaccum._types import Fun, PyTree

# ``window(args, spec)``: the two passes on one device's (or the whole) batch.
Window = Fun


class DeviceRows(NamedTuple):
    """Where the window's rows are: the whole batch here (no ``data_axes``),
    or each device's contiguous share of it, in the order of its index over
    ``data_axes`` (a batch sharded on axis 0). Without data axes every step
    is the identity, so one code path serves both.

    Attributes:
      data_axes: the manual mesh axes the batch's rows are split over.
    """

    data_axes: tuple[str, ...] = ()

    def encoder_args(self, args: tuple, spec: WindowSpec) -> tuple:
        """``args`` with the keys the encoder draws: folded with the device's
        index (as shard_value_and_grad folds them), so that devices draw
        independent randomness for their rows. The loss keeps the call's."""
        if not self.data_axes:
            return args
        keys = tuple(args[num] for num in spec.key_nums)
        folded = fold_device_index(keys, self.data_axes)
        return tuple(placed(args, spec.key_nums, folded))

    def varying(self, diff: tuple) -> tuple:
        """The parameters typed as differing between devices, so that no
        pullback sums their gradients over the devices by itself (a replicated
        input's cotangent is a ``psum``): the one reduction is :meth:`reduce`'s."""
        if not self.data_axes:
            return diff
        return lax.pcast(diff, self.data_axes, to="varying")

    def gather(self, outputs: PyTree) -> PyTree:
        """The whole batch's outputs on every device, in the batch's order:
        device ``d`` holds rows ``[d R, (d + 1) R)``, so a tiled all-gather in
        the devices' order is the batch's order. One all-gather per dtype:
        the leaves of a dtype travel side by side as the columns of one
        ``(R, ...)`` array."""
        if not self.data_axes:
            return outputs
        leaves, treedef = jax.tree.flatten(outputs)
        gathered: list[Any] = [None] * len(leaves)
        for dtype in dict.fromkeys(leaf.dtype for leaf in leaves):
            indices = [i for i, leaf in enumerate(leaves) if leaf.dtype == dtype]
            columns = [leaves[i].reshape(leaves[i].shape[0], -1) for i in indices]
            whole = lax.all_gather(
                jnp.concatenate(columns, axis=1), self.data_axes, axis=0, tiled=True
            )
            splits = np.cumsum([column.shape[1] for column in columns])[:-1]
            for i, part in zip(indices, jnp.split(whole, splits, axis=1), strict=True):
                gathered[i] = part.reshape(-1, *leaves[i].shape[1:])
        return jax.tree.unflatten(treedef, gathered)

    def own_rows(self, cotangents: PyTree) -> PyTree:
        """This device's rows of the whole batch's cotangents (a slice)."""
        if not self.data_axes:
            return cotangents
        index = lax.axis_index(self.data_axes)
        size = lax.axis_size(self.data_axes)

        def rows(ct: jax.Array) -> jax.Array:
            if not jnp.issubdtype(ct.dtype, jnp.inexact):
                return ct[: ct.shape[0] // size]  # float0: no data to take
            count = ct.shape[0] // size
            return lax.dynamic_slice_in_dim(ct, index * count, count)

        return jax.tree.map(rows, cotangents)

    def reduce(self, sums: tuple, whole: LossGrad) -> tuple[tuple, tuple]:
        """``(value, aux)`` and the gradients: pass 2's sums plus the loss's
        direct part (a temperature's, a bias's), counted once.

        Per device, the loss and its direct part are the same on every
        device, so only device 0 adds them and the others add zeros (exact):
        one ``psum`` of the gradients, the value and aux, after the loop.
        """
        if not self.data_axes:
            grads = jax.tree.map(_add, sums, whole.diff_grads)
            return (whole.value, whole.aux), grads
        first = lax.axis_index(self.data_axes) == 0

        def once(x: Any) -> jax.Array:
            x = jnp.asarray(x)
            if x.dtype == jnp.bool_:
                return once(x.astype(jnp.int32))
            return jnp.where(first, x, jnp.zeros_like(x))

        local = jax.tree.map(lambda s, d: _add(s, once(d)), sums, whole.diff_grads)
        loss_out = jax.tree.map(once, (whole.value, whole.aux))
        loss_out, grads = lax.psum((loss_out, local), self.data_axes)
        loss_out = jax.tree.map(
            lambda total, x: total.astype(jnp.result_type(x)),
            loss_out,
            (whole.value, whole.aux),
        )
        return loss_out, grads


def _add(total: jax.Array, direct: jax.Array) -> jax.Array:
    return total + direct.astype(total.dtype)


def mesh_axes(mesh: Any, data_axis: str | Sequence[str] | None) -> tuple[str, ...]:
    """The data axes of a window per device, none without ``mesh`` and
    ``data_axis``; with ``mesh``, checked to be in it (as for
    :func:`jaxaccum.shard_value_and_grad`)."""
    if mesh is None and data_axis is None:
        return ()
    data_axes = data_axes_of("data" if data_axis is None else data_axis)
    if mesh is not None:
        resolve_mesh(mesh, data_axes, jax.sharding.get_abstract_mesh)
    return data_axes


def per_device(window: Window, spec: WindowSpec, mesh: Any) -> Fun:
    """``window`` run on each device of ``mesh`` (else the one set with
    ``jax.set_mesh``), manual over ``spec.data_axes``: a device's rows, its
    share of each micro-batch, parameters and other arguments replicated."""

    def cached(*args: PyTree) -> PyTree:
        check_arg_count(args, spec)
        device_mesh = call_mesh(mesh, spec.data_axes)
        check_replicated(args, spec)
        batch_size = rows_over_devices(args, spec, device_mesh)
        device_spec = per_device_options(spec, batch_size, device_mesh, can_pad=False)
        return run_per_device(
            lambda *device_args: window(device_args, device_spec),
            args,
            {},
            spec,
            device_mesh,
            tuple(PartitionSpec() for _ in spec.diff_nums),
        )

    return cached


def check_replicated(args: tuple, spec: WindowSpec) -> None:
    """Every differentiated leaf is replicated over the data axes (FSDP, a
    parameter sharded over them, is not supported per device yet).

    Raises:
      ValueError: naming the leaf, its shape and sharding, and the fix.
    """
    for num in spec.diff_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[num]):
            sharding = explicit_sharding(jax.typeof(leaf))
            spec_of = PartitionSpec() if sharding is None else sharding.spec
            if any(set(spec_names(e)) & set(spec.data_axes) for e in spec_of):
                raise ValueError(
                    f"Parameter args[{num}]{jax.tree_util.keystr(path)} of shape "
                    f"{jnp.shape(leaf)} is sharded {spec_of} over the data "
                    f"axes {spec.data_axes} (FSDP): cached_value_and_grad with "
                    "mesh= takes parameters replicated over the data axes, an "
                    "FSDP layout is not supported per device yet. Replicate it "
                    "(jax.sharding.reshard(leaf, P())), or call "
                    "cached_value_and_grad without mesh= under jit, which takes "
                    "any sharding."
                )
