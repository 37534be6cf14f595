"""A call's arguments as the window over a named axis reads them: flat, by
role, each leaf a :class:`Value` (the batch's leaves per micro-batch as their
free strided views, the keys split per micro-batch, everything else shared),
and one micro-batch's values ``fun`` is traced at (values, not shapes: their
types carry their shardings)."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._axis._collectives import Value
from jaxaccum._window import _split
from jaxaccum._window._accum_dtypes import accum_dtype_for
from jaxaccum._window._batch_nodes import label
from jaxaccum._window._microbatch import fold_device_index, microbatch_keys
from jaxaccum._window._spec import WindowSpec


def _is_array(leaf: Any, role: Any) -> bool:
    """Whether ``leaf`` is traced: an array, or a Python number that is
    differentiated or split; the others stay Python values (``train=True``,
    ``num_classes=10``, ``dtype=jnp.int8``), static as under ``jax.vmap``."""
    if hasattr(leaf, "dtype") and not isinstance(leaf, type):
        return True
    return role is not None and isinstance(leaf, int | float | complex)


class FlatCall(NamedTuple):
    """The call's array leaves, flat: the differentiated ones first.

    Attributes:
      values: each leaf's :class:`Value` (differentiated leaves in
        ``accum_dtype`` at least, so their gradient sums in it).
      examples: each leaf as one micro-batch sees it (micro-batch 0's),
        what ``fun`` is traced at.
      num_diff: how many leading leaves are differentiated.
      rebuild: ``rebuild(leaves) -> (args, kwargs)``, the call with its
        array leaves replaced (the others kept).
    """

    values: list[Value]
    examples: list[Any]
    num_diff: int
    rebuild: Callable[[list], tuple[tuple, dict]]


def flat_call(
    args: tuple, kwargs: dict, spec: WindowSpec, size: int, keys: tuple
) -> FlatCall:
    """The call by role: ``keys`` are the key arguments split into ``size``."""
    roles = {num: "diff" for num in spec.diff_nums}
    roles.update({num: "batch" for num in spec.batch_nums})
    roles.update({num: "key" for num in spec.key_nums})
    placed = list(args)
    for num, split in zip(spec.key_nums, keys, strict=True):
        placed[num] = split
    order = [*spec.diff_nums, *(i for i in range(len(args)) if i not in spec.diff_nums)]
    tree = ([placed[i] for i in order], kwargs)
    leaves, treedef = jax.tree.flatten(tree)
    role_of = _leaf_roles([roles.get(i) for i in order], tree)
    values, examples, arrays = [], [], []
    for position, (leaf, role) in enumerate(zip(leaves, role_of, strict=True)):
        if not _is_array(leaf, role):
            continue
        arrays.append(position)
        value, example = _leaf_value(jnp.asarray(leaf), role, size, spec)
        values.append(value)
        examples.append(example)
    num_diff = sum(1 for role in role_of if role == "diff")

    def rebuild(new: list) -> tuple[tuple, dict]:
        full = list(leaves)
        for position, leaf in zip(arrays, new, strict=True):
            full[position] = leaf
        ordered, new_kwargs = jax.tree.unflatten(treedef, full)
        call = [None] * len(args)
        for i, arg in zip(order, ordered, strict=True):
            call[i] = arg
        return tuple(call), new_kwargs

    return FlatCall(values, examples, num_diff, rebuild)


def _leaf_roles(arg_roles: list, tree: tuple) -> list:
    """Each leaf's role: its argument's (keyword arguments are shared)."""
    ordered, kwargs = tree
    roles = []
    for role, arg in zip(arg_roles, ordered, strict=True):
        roles.extend([role] * len(jax.tree.leaves(arg)))
    return roles + [None] * len(jax.tree.leaves(kwargs))


def _leaf_value(leaf: jax.Array, role: Any, size: int, spec: WindowSpec) -> tuple:
    """One leaf's :class:`Value` and its value for micro-batch 0."""
    if role == "batch":
        # Free views: (B / N, N, ...) strided, (N, B / N, ...) contiguous.
        axis = 1 if spec.axis_layout == "strided" else 0
        if axis:
            view = _split.strided_view([leaf], size)[0]
        else:
            view = leaf.reshape(size, leaf.shape[0] // size, *leaf.shape[1:])
        first = lax.index_in_dim(view, 0, axis=axis, keepdims=False)
        return Value(view, stacked=True, axis=axis), first
    if role == "key":  # split into (N, ...) already
        return Value(leaf, stacked=True), leaf[0]
    if role == "diff":
        accum = accum_dtype_for(leaf.dtype, spec.accum_dtype)
        return Value(leaf.astype(accum)), leaf
    return Value(leaf), leaf


def split_keys(args: tuple, spec: WindowSpec, size: int) -> tuple:
    """Each key argument split into ``size`` keys, as the core splits them
    (the key itself, stacked once, for one micro-batch); per device, folded
    with the device's index first (as the core folds them)."""
    keys = tuple(args[num] for num in spec.key_nums)
    if spec.data_axes:
        keys = fold_device_index(keys, spec.data_axes)
    return microbatch_keys(keys, size)


def batch_split(args: tuple, spec: WindowSpec) -> _split.Split:
    """The batch's split, checked as the core checks it (no padding); a
    contiguous one only where no batch leaf is sharded over devices.

    Raises:
      ValueError: for ``axis_layout="contiguous"`` and a leaf whose rows are
        sharded over devices (each block would move to one device).
    """
    labelled = [(f"args[{i}]", args[i]) for i in spec.batch_nums]
    split = _split.resolve_num_microbatches(
        _split.batch_size_of(labelled),
        spec.num_microbatches,
        spec.microbatch_size,
        can_pad=False,
    )
    if spec.axis_layout == "contiguous":
        for prefix, batch in labelled:
            _check_unsharded_rows(prefix, batch)
    return split


def _check_unsharded_rows(prefix: str, batch: Any) -> None:
    """No leaf of ``batch`` has its rows sharded over several devices.

    Raises:
      ValueError: naming the leaf and its mesh axes.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        names, devices = _split.axis0_devices(leaf)
        if devices > 1:
            raise ValueError(
                f"Batch leaf {label(prefix, path)} has its rows "
                f"sharded over {devices} devices (mesh axes {names}): with "
                "axis_layout='contiguous' micro-batch k would be the k-th "
                "block of rows, held by some of the devices, and the window "
                "would move rows between them. Run the window per device, "
                "jaxaccum.shard_value_and_grad(..., axis_layout='contiguous'), "
                "where each device's block is split into N contiguous blocks "
                "(members in data parallelism's order, device by device), or "
                "use axis_layout='strided', which keeps every micro-batch "
                "spread over the devices."
            )
