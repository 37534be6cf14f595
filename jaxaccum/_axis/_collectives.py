"""What a collective over the window means for the micro-batches' values.

A value of the traced ``fun`` is either the same on every micro-batch
(shared: parameters, constants, a collective's result) or one per
micro-batch (stacked: the window's axis at ``axis`` of its array). Over the
window, ``psum`` is a sum across the stacked axis (``N`` times a shared
value), ``pmax`` and ``pmin`` a max and a min, ``all_gather`` the stacked
values themselves in micro-batch order, and ``axis_index`` the micro-batch's
index (JAX writes an index over several axes as one per axis); positions a
``vmap`` inside ``fun`` added to the axes reduce as ``jax.vmap`` reduces
them, and other names (a device axis under ``shard_map``) reduce after the
window, by their own collective. A window that joins a device axis (its name
is the data axis's, ``joined``) is that axis's ``D x N`` members: each
collective over it reduces across the micro-batches, then across the devices,
and member ``(d, k)`` is index ``d N + k``.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxaccum._axis._trace import as_tuple
from jaxaccum._window._split import explicit_sharding


class Value(NamedTuple):
    """A value of the traced ``fun`` during the window.

    Attributes:
      array: the array: one micro-batch's shape if shared, else with the
        window's ``N`` inserted at ``axis``.
      stacked: whether it differs between micro-batches.
      axis: where the window's axis is, if stacked (1 for a batch's free
        strided view, 0 for values a segment computed).
    """

    array: Any
    stacked: bool = False
    axis: int = 0

    def leading(self, size: int) -> Any:
        """The array with the window's axis first (broadcast if shared)."""
        if self.stacked:
            return jnp.moveaxis(self.array, self.axis, 0)
        array = jnp.asarray(self.array)
        return jnp.broadcast_to(array, (size, *array.shape))


def _split_axes(axes: Any, axis_name: Any, joined: bool) -> tuple[tuple, tuple]:
    """A collective's positions, and the names it reduces over across devices
    (the window's too where it joins a device axis)."""
    axes = as_tuple(axes)
    positions = tuple(a for a in axes if isinstance(a, int))
    others = tuple(
        a for a in axes if not isinstance(a, int) and (a != axis_name or joined)
    )
    return positions, others


_REDUCERS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "psum": (jnp.sum, lax.psum),
    "pmax": (jnp.max, lax.pmax),
    "pmin": (jnp.min, lax.pmin),
}


def reduce_over_window(
    name: str,
    operands: list[Value],
    params: dict,
    axis_name: Any,
    size: int,
    joined: bool = False,
) -> list[Value]:
    """``psum``, ``pmax`` or ``pmin`` over axes that include the window's."""
    reduce, collective = _REDUCERS[name]
    positions, others = _split_axes(params["axes"], axis_name, joined)
    results = []
    for operand in operands:
        dtype = jnp.result_type(operand.array)
        if operand.stacked:
            array = reduce(operand.leading(size), axis=0)
        elif name == "psum":  # the same value on each of N micro-batches
            array = operand.array * jnp.asarray(size, dtype)
        else:
            array = operand.array
        if positions:
            array = reduce(array, axis=positions)
        if others:
            array = collective(array, others)
        # A collective keeps its operand's dtype (jnp.sum widens integers).
        results.append(Value(jnp.asarray(array).astype(dtype)))
    return results


def gather_over_window(
    operand: Value, params: dict, axis_name: Any, size: int, joined: bool = False
) -> Value:
    """``all_gather`` over the window (and device axes with it, the window's
    first or last): every member's value, in the members' order (the first
    name varies slowest), at ``all_gather_dimension`` (``tiled``: merged into
    it)."""
    names = as_tuple(params["axis_name"])
    if joined:  # the devices outside, the micro-batches inside, as below
        _window_only("all_gather", params, axis_name, "gather the joined axis alone")
        others: tuple = (axis_name,)
    else:
        others = tuple(name for name in names if name != axis_name)
        if others and names not in ((axis_name, *others), (*others, axis_name)):
            raise TypeError(
                f"all_gather over {names} puts the window's axis {axis_name!r} "
                "between two others: put it first or last."
            )
    dimension = params["all_gather_dimension"]
    gathered = jnp.moveaxis(_replicated(operand.leading(size)), 0, dimension)
    if others:  # (.., D, N, ..): the devices outside, the micro-batches inside
        gathered = lax.all_gather(gathered, others, axis=dimension)
        if names[0] == axis_name and not joined:
            gathered = jnp.swapaxes(gathered, dimension, dimension + 1)
        gathered = _merge(gathered, dimension)
    if params["tiled"]:
        gathered = _merge(gathered, dimension)
    return Value(gathered)


def _merge(array: Any, dimension: int) -> Any:
    """``array`` with its dimensions ``dimension`` and the next merged."""
    shape = array.shape
    merged = (shape[dimension] * shape[dimension + 1],)
    return array.reshape(*shape[:dimension], *merged, *shape[dimension + 2 :])


def _window_only(name: str, params: dict, axis_name: Any, fix: str) -> None:
    """A gather or an index over the window's axis alone.

    Raises:
      TypeError: for one over the window's axis and others, saying ``fix``.
    """
    names = as_tuple(params["axis_name"])
    if names != (axis_name,):
        raise TypeError(
            f"{name} over {names} mixes the window's axis {axis_name!r} with "
            f"others: {fix}."
        )


def _replicated(array: Any) -> Any:
    """``array`` replicated where its type holds an Explicit sharding (the
    gathered value is every device's: its rows, sharded over the devices in
    each micro-batch, cannot stay sharded once the micro-batches are merged)."""
    if explicit_sharding(jax.typeof(array)) is None:
        return array
    return jax.sharding.reshard(array, PartitionSpec())


def index_over_window(
    params: dict, axis_name: Any, size: int, joined: bool = False
) -> Value:
    """``axis_index`` of the window: micro-batch ``k``'s is ``k`` (``d N + k``
    on device ``d`` of a joined axis)."""
    _window_only("axis_index", params, axis_name, "take each axis's index on its own")
    index = jnp.arange(size, dtype=jnp.int32)
    if joined:
        index = index + lax.axis_index(axis_name).astype(jnp.int32) * size
    return Value(index, stacked=True)


def index_groups(
    name: str, params: dict, axis_name: Any, size: int, joined: bool
) -> tuple | None:
    """A collective's ``axis_index_groups`` over the window's members (None
    without), checked: over the window's axis alone, each member in exactly
    one group, the groups of one size (as ``pmap`` requires them).

    Raises:
      TypeError: for groups over the window and other axes.
      ValueError: for groups that do not partition the ``size`` members.
    """
    groups = params.get("axis_index_groups")
    if groups is None:
        return None
    names = as_tuple(params.get("axes", params.get("axis_name")))
    if names != (axis_name,) or joined:
        raise TypeError(
            f"{name} over {names} with axis_index_groups: groups are computed "
            f"over the window's axis {axis_name!r} alone (each group of "
            "micro-batches its own reduction, as pmap does); split the "
            "collective into one over the window and one over the other axes."
        )
    members = sorted(member for group in groups for member in group)
    if members != list(range(size)) or len({len(group) for group in groups}) > 1:
        raise ValueError(
            f"{name} over the window's axis {axis_name!r} has "
            f"axis_index_groups={[list(group) for group in groups]}, which do "
            f"not split its {size} members (one per micro-batch) into groups "
            "of one size that hold each member once. Write groups for N = "
            f"{size} micro-batches, or drop axis_index_groups to reduce over "
            "the whole window (the big batch's statistics)."
        )
    return tuple(tuple(group) for group in groups)


def _in_groups(name: str, operand: Value, params: dict, groups: tuple) -> Value:
    """``psum``, ``pmax``, ``pmin`` or ``all_gather`` within each group of
    micro-batches: member ``k`` receives its group's result."""
    size = sum(len(group) for group in groups)
    group_of = [0] * size
    for number, group in enumerate(groups):
        for member in group:
            group_of[member] = number
    if name != "all_gather" and not operand.stacked:
        if name == "pmax" or name == "pmin":
            return operand
        count = jnp.asarray(len(groups[0]), jnp.result_type(operand.array))
        return Value(operand.array * count)
    grouped = _replicated(operand.leading(size))[jnp.asarray(groups)]
    if name != "all_gather":
        reduce = _REDUCERS[name][0]
        reduced = reduce(grouped, axis=1).astype(grouped.dtype)
        return Value(reduced[jnp.asarray(group_of)], stacked=True)
    dimension = params["all_gather_dimension"] + 1  # after the members' axis
    gathered = jnp.moveaxis(grouped[jnp.asarray(group_of)], 1, dimension)
    if params["tiled"]:
        gathered = _merge(gathered, dimension)
    return Value(gathered, stacked=True)


def over_window(
    name: str,
    operands: list[Value],
    params: dict,
    axis_name: Any,
    size: int,
    joined: bool = False,
) -> list[Value]:
    """The results of the collective ``name`` over the window (``joined``:
    the window joins the device axis of its name)."""
    groups = index_groups(name, params, axis_name, size, joined)
    if groups is not None:
        return [_in_groups(name, operand, params, groups) for operand in operands]
    if name == "all_gather":
        return [gather_over_window(operands[0], params, axis_name, size, joined)]
    if name == "axis_index":
        return [index_over_window(params, axis_name, size, joined)]
    return reduce_over_window(name, operands, params, axis_name, size, joined)
