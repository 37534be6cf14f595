"""Batch -> micro-batches: strided, copy-free, validated.

Why strided: micro-batch ``k`` holds examples ``k, k + N, k + 2N, ...``. The
view ``(B, ...) -> (B // N, N, ...)`` is a free reshape, and micro-batch ``k`` is
column ``k`` of it. For a batch sharded over devices on axis 0, every device's
rows stay on that device for every micro-batch; a contiguous split would give
micro-batch ``k`` to a few devices only and make XLA move data between them.
Indexing the view inside the scan (rather than materialising a transposed
``(N, B // N, ...)`` copy first) keeps the batch from being copied at all.

With ``D`` devices on axis 0, device ``d`` holds rows ``[d B/D, (d+1) B/D)``,
which are rows ``[d B/(D N), (d+1) B/(D N))`` of the view: the view stays
sharded on its axis 0 when ``D`` divides ``B // N``. Under an Explicit mesh the
reshape is given that sharding (it cannot be inferred), and other splits are an
error (see :func:`check_sharded_split`).
"""

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxaccum._checks import check_count
from jaxaccum._types import Batch, PyTree
from jaxaccum._window._batch_nodes import (
    check_static_sizes,
    label,
    relabelled,
    resized_treedef,
)


def divisors(size: int) -> list[int]:
    """The positive divisors of ``size``, increasing: the ``N`` that split it."""
    small = [d for d in range(1, math.isqrt(size) + 1) if size % d == 0]
    return small + [size // d for d in reversed(small) if d * d != size]


class Split(NamedTuple):
    """How one batch splits into micro-batches.

    Attributes:
      num_microbatches: ``N``.
      batch_size: ``B``, the real rows.
      padded_size: ``B`` padded up to a multiple of ``N`` (``B`` without pad).
    """

    num_microbatches: int
    batch_size: int
    padded_size: int

    @property
    def microbatch_size(self) -> int:
        return self.padded_size // self.num_microbatches


def batch_size_of(batches: Sequence[tuple[str, Any]]) -> int:
    """Returns the common leading size of every leaf of the labelled batches.

    Args:
      batches: ``(label, pytree)`` pairs; the label prefixes leaf paths in errors.

    Raises:
      ValueError: if there are no leaves, a leaf is a scalar, leading sizes
        differ, or a pytree node keeps the batch size in its static data.
    """
    sizes: dict[str, int] = {}
    for prefix, batch in batches:
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(
                    f"Batch leaf {label(prefix, path)} is a scalar (shape ()); "
                    "every leaf of a batch argument needs a leading batch axis. "
                    "Pass per-batch constants as a non-batch argument instead."
                )
            sizes[label(prefix, path)] = shape[0]
    if not sizes:
        raise ValueError(
            "The batch argument(s) contain no arrays; nothing to split into "
            "micro-batches. Check batch_argnums."
        )
    if 0 in sizes.values():
        empty = next(name for name, size in sizes.items() if size == 0)
        raise ValueError(
            f"Batch leaf {empty} has 0 rows: an empty batch has no gradient to "
            "accumulate. Pass at least one example (skip empty batches in the "
            "data loader)."
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(
            "All batch leaves must share the same leading (batch) size, got "
            f"{listing}. Make every batch leaf have the same first dimension, "
            "or move leaves without a batch axis to a non-batch argument."
        )
    size = next(iter(sizes.values()))
    check_static_sizes(batches, size)
    return size


def resolve_num_microbatches(
    batch_size: int,
    num_microbatches: int | None,
    microbatch_size: int | None,
    *,
    pad: bool = False,
    can_pad: bool = True,
) -> Split:
    """Returns the :class:`Split` of a batch, checking that N divides it.

    With ``pad`` a batch that N does not divide is padded up to the next
    multiple (``N * ceil(B / N)``, or ``microbatch_size * ceil(B / size)``).
    ``can_pad``: whether the caller takes ``pad`` (the error suggests it only
    then).
    """
    if microbatch_size is not None:
        num = -(-batch_size // microbatch_size)
        if batch_size % microbatch_size and not pad:
            raise ValueError(
                f"Batch size {batch_size} is not divisible by "
                f"microbatch_size={microbatch_size}. Micro-batch sizes that "
                f"divide it: {divisors(batch_size)}"
                + (
                    "; or pass pad=True (with reduction='weighted' or 'sum') to "
                    "pad the last micro-batches."
                    if can_pad
                    else "."
                )
            )
        return Split(num, batch_size, num * microbatch_size)
    assert num_microbatches is not None
    if batch_size % num_microbatches and not pad:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by "
            f"num_microbatches={num_microbatches}, so the micro-batches would "
            f"have unequal sizes. Choose num_microbatches from "
            f"{divisors(batch_size)}, "
            + (
                "change the batch size, or pass pad=True (with "
                "reduction='weighted' or 'sum') to pad with masked rows."
                if can_pad
                else "or change the batch size."
            )
        )
    padded_size = num_microbatches * -(-batch_size // num_microbatches)
    return Split(num_microbatches, batch_size, padded_size)


def pad_batch(batch: Batch, padded_size: int) -> PyTree:
    """Appends rows to every leaf so its leading size is ``padded_size``.

    The rows are zeros, or for typed PRNG keys (which have no zero) copies of
    the first row: valid keys, whose rows are masked out like every padded row.
    Registered batch nodes (:func:`register_batch_node`) are resized to
    ``padded_size`` rows.
    """

    def pad(x):
        missing = padded_size - x.shape[0]
        if not missing:
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            fill = jnp.broadcast_to(x[:1], (missing, *x.shape[1:]))
            return jnp.concatenate([x, fill])
        return jnp.pad(x, [(0, missing)] + [(0, 0)] * (x.ndim - 1))

    padded = jax.tree.map(pad, batch)
    return relabelled(padded, np.shape(jax.tree.leaves(batch)[0])[0])


def explicit_sharding(aval: Any) -> NamedSharding | None:
    """The sharding of ``aval`` (an aval or ShapeDtypeStruct) if it is on an
    Explicit mesh, else None (no mesh, or Auto axes: XLA propagates those)."""
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, NamedSharding) and (
        AxisType.Explicit in sharding.mesh.axis_types
    ):
        return sharding
    return None


def spec_names(entry: Any) -> tuple[str, ...]:
    """The mesh axis names of one ``PartitionSpec`` entry, as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axis0_devices(leaf: PyTree) -> tuple[tuple[str, ...], int]:
    """The Explicit mesh axes a leaf's axis 0 is sharded over, and their size."""
    sharding = explicit_sharding(jax.typeof(leaf))
    if sharding is None or not sharding.spec or sharding.spec[0] is None:
        return (), 1
    names = sharding.spec[0]
    names = (names,) if isinstance(names, str) else tuple(names)
    return names, int(np.prod([sharding.mesh.shape[name] for name in names]))


def check_sharded_split(
    batches: Sequence[tuple[str, Any]], batch_size: int, num_microbatches: int
) -> None:
    """Checks that each device holds the same rows of every micro-batch.

    For a batch explicitly sharded over ``D`` devices on axis 0, micro-batch
    ``k`` stays spread over all of them, without moving rows, only if ``D``
    divides ``B // N`` (each device's ``B / D`` rows split into ``N`` equal
    parts). Auto-sharded batches are not visible at trace time and not checked.

    Args:
      batches: ``(label, pytree)`` pairs; the label prefixes leaf paths in errors.
      batch_size: ``B``, after any padding.
      num_microbatches: ``N``.

    Raises:
      ValueError: naming the leaf, its mesh axes and the sizes, if not.
    """
    rows = batch_size // num_microbatches
    for prefix, batch in batches:
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            names, devices = axis0_devices(leaf)
            if rows % devices:
                local = batch_size // devices
                raise ValueError(
                    f"Batch leaf {label(prefix, path)} has {batch_size} rows "
                    f"sharded over {devices} devices on axis 0 (mesh axes "
                    f"{names}): {batch_size / devices:g} per device, which "
                    f"num_microbatches={num_microbatches} does not split into "
                    "equal parts, so micro-batches would move rows between "
                    f"devices. Use a batch size that is a multiple of {devices} "
                    f"* num_microbatches = {devices * num_microbatches}"
                    + (
                        f", or num_microbatches from {divisors(local)}."
                        if local and batch_size % devices == 0
                        else "."
                    )
                )


def strided_view(batch: Batch, num_microbatches: int) -> PyTree:
    """Reshapes every leaf ``(B, ...)`` to the free view ``(B // N, N, ...)``.

    Under an Explicit mesh the view keeps the leaf's sharding, axis 0's devices
    on the view's axis 0 (valid after :func:`check_sharded_split`).
    """

    def view(x):
        shape = (x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
        sharding = explicit_sharding(jax.typeof(x))
        if sharding is None:
            return jnp.reshape(x, shape)
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        out = NamedSharding(sharding.mesh, PartitionSpec(spec[0], None, *spec[1:]))
        return jnp.reshape(x, shape, out_sharding=out)

    return jax.tree.map(view, batch)


def take_microbatch(view: PyTree, index: jax.typing.ArrayLike) -> PyTree:
    """Micro-batch ``index`` (examples ``index, index + N, ...``) of a view."""
    return jax.tree.map(
        lambda x: lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False), view
    )


class StridedBatch(NamedTuple):
    """A batch as its leaves' strided views, and its structure at one
    micro-batch's size (:func:`register_batch_node`)."""

    views: list
    treedef: Any

    def microbatch(self, index: jax.typing.ArrayLike) -> PyTree:
        """Micro-batch ``index``, a pytree like the batch."""
        return jax.tree.unflatten(self.treedef, take_microbatch(self.views, index))


def strided_batch(batch: Batch, num_microbatches: int) -> StridedBatch:
    """``batch`` (of ``B`` rows, ``N`` dividing it) ready to be taken apart
    micro-batch by micro-batch; no node is rebuilt at the view's shapes."""
    leaves = jax.tree.leaves(batch)
    rows = leaves[0].shape[0] // num_microbatches
    return StridedBatch(
        strided_view(leaves, num_microbatches), resized_treedef(batch, rows)
    )


def split_batch(batch: Batch, num_microbatches: int) -> PyTree:
    """Splits a batch into ``num_microbatches`` strided micro-batches.

    Micro-batch ``k`` holds examples ``k, k + N, k + 2N, ...``: the same split
    that :func:`jaxaccum.value_and_grad` uses, for users who write their own
    loop. Unlike ``value_and_grad`` (which indexes a free view inside its scan),
    this materialises the stacked ``(N, B // N, ...)`` arrays.

    Args:
      batch: a pytree of arrays sharing a leading batch axis of size ``B``.
      num_microbatches: ``N``, a positive int dividing ``B``.

    Returns:
      A pytree like ``batch`` whose leaves have shape ``(N, B // N, ...)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> jaxaccum.split_batch(jnp.arange(6), 2)
      Array([[0, 2, 4],
             [1, 3, 5]], dtype=int32)
    """
    check_count("num_microbatches", num_microbatches)
    size = batch_size_of([("batch", batch)])
    resolve_num_microbatches(size, num_microbatches, None, can_pad=False)
    views = strided_view(jax.tree.leaves(batch), num_microbatches)
    return jax.tree.unflatten(
        resized_treedef(batch, size // num_microbatches),
        [jnp.swapaxes(view, 0, 1) for view in views],
    )


def pad_microbatches(
    batch: Batch, num_microbatches: int, max_microbatches: int
) -> PyTree:
    """Lays a batch of ``num_microbatches`` micro-batches out as one of
    ``max_microbatches``, the last ones empty (zeros; typed PRNG keys, which
    have no zero, copies of a valid key), for ``masked=True``.

    Micro-batch ``k < num_microbatches`` of the result (its rows ``k, k + M,
    ...``, as :func:`split_batch` splits) holds the rows of micro-batch ``k``
    of ``batch``, so ``value_and_grad(fun, M, masked=True)`` with
    ``active_microbatches=num_microbatches`` on the result equals
    ``value_and_grad(fun, num_microbatches)`` on ``batch``, from one compiled
    program for every size. Call it in the data loader, outside ``jit``:
    NumPy leaves stay NumPy, so nothing compiles per size.

    Args:
      batch: a pytree of arrays sharing a leading axis of ``N b`` rows.
      num_microbatches: ``N``, the micro-batches ``batch`` holds.
      max_microbatches: ``M >= N``, the window's largest number of them.

    Returns:
      ``batch`` with ``M b`` rows per leaf.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> step = jax.jit(jaxaccum.value_and_grad(loss, 4, masked=True))
      >>> x = np.arange(12.0).reshape(6, 2)  # 2 micro-batches of 3
      >>> window = jaxaccum.pad_microbatches(x, 2, 4)
      >>> window.shape
      (12, 2)
      >>> value, grads = step(jnp.ones(2), window, active_microbatches=2)
      >>> bool(jnp.allclose(value, loss(jnp.ones(2), x)))
      True
    """
    check_count("max_microbatches", max_microbatches)
    check_count("num_microbatches", num_microbatches)
    if num_microbatches > max_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} is above "
            f"max_microbatches={max_microbatches}: the window cannot hold it."
        )
    size = batch_size_of([("batch", batch)])
    if size % num_microbatches:
        raise ValueError(
            f"The batch has {size} rows, which num_microbatches="
            f"{num_microbatches} does not divide: pad_microbatches lays out "
            "micro-batches of equal size. Pass a batch of num_microbatches * "
            "microbatch_size rows (num_microbatches from "
            f"{divisors(size)} divide {size})."
        )
    rows = size // num_microbatches
    missing = max_microbatches - num_microbatches

    def pad(x: PyTree) -> PyTree:
        view = x.reshape(rows, num_microbatches, *x.shape[1:])
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # no zero: valid keys
            fill = jnp.broadcast_to(view[:, :1], (rows, missing, *x.shape[1:]))
            view = jnp.concatenate([view, fill], axis=1)
        else:
            numpy = np if isinstance(x, np.ndarray) else jnp
            widths = [(0, 0), (0, missing)] + [(0, 0)] * (x.ndim - 1)
            view = numpy.pad(view, widths)
        return view.reshape(rows * max_microbatches, *x.shape[1:])

    return jax.tree.unflatten(
        resized_treedef(batch, rows * max_microbatches),
        [pad(leaf) for leaf in jax.tree.leaves(batch)],
    )
