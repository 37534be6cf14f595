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

import collections
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxaccum._options import check_count
from jaxaccum._types import Batch, PyTree


def _label(prefix: str, path: tuple) -> str:
    return prefix + jax.tree_util.keystr(path)


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


# Containers whose flattening data is their keys or type, never a size.
_PLAIN_NODES = (tuple, list, dict, collections.OrderedDict, collections.defaultdict)
# register_batch_node's registry: node type -> how its static data is resized
# to a micro-batch's rows (None: it holds no batch size).
_BATCH_NODES: dict[type, Callable[[Any, int], Any] | None] = {}


def register_batch_node(
    node_type: type, resize: Callable[[Any, int], Any] | None = None
) -> None:
    """Declares how jaxaccum splits a pytree node type whose static data
    (its ``tree_flatten`` aux data) mentions the batch size.

    jaxaccum refuses a batch node whose static data holds an integer equal to
    the batch size: it cuts the node's arrays into micro-batches but cannot
    know what that integer means. Registering the type says it. With
    ``resize=None`` the static data holds no batch size (a ``num_classes``
    that happens to equal it) and the node splits like any pytree; with
    ``resize``, every micro-batch is built with ``resize(static, size)``, the
    static data of the node holding ``size`` rows, which jaxaccum checks. The
    registration is process-wide; registering a type again replaces its entry.
    Guide, with haliax's ``NamedArray``: [In-step
    accumulation](../guides/in-step.md#batches-are-arrays-or-pytrees-of-arrays).

    Args:
      node_type: the pytree node class (not a leaf type such as ``int`` or an
        array).
      resize: ``resize(static, size) -> static``, called with two positional
        arguments, or None.

    Raises:
      TypeError: for a node type that is not a class or is a leaf type, or a
        ``resize`` that is not a function of two arguments.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> @jax.tree_util.register_pytree_node_class
      ... class Rows:
      ...     def __init__(self, x, size):
      ...         self.x, self.size = x, size
      ...     def tree_flatten(self):
      ...         return (self.x,), self.size
      ...     @classmethod
      ...     def tree_unflatten(cls, size, children):
      ...         return cls(children[0], size)
      >>> jaxaccum.register_batch_node(Rows, lambda static, size: size)
      >>> loss = lambda w, rows: jnp.sum(rows.x @ w) / rows.size
      >>> step = jaxaccum.value_and_grad(loss, 2)
      >>> float(step(jnp.ones(2), Rows(jnp.ones((4, 2)), 4))[0])
      2.0
    """
    if not isinstance(node_type, type):
        raise TypeError(f"node_type must be a class, got {node_type!r}.")
    if issubclass(node_type, _LEAF_TYPES):
        raise TypeError(
            f"node_type {node_type.__name__} is a leaf type, not a pytree node: "
            "jaxaccum splits its values by their leading axis already. Register "
            "the pytree node class whose static (tree_flatten aux) data holds "
            "the batch size."
        )
    if not _is_pytree_node(node_type):
        raise TypeError(
            f"node_type {node_type.__name__} is not a pytree node type: JAX "
            "takes its values as leaves, so nothing registered for it could "
            "apply. Register it with JAX first (jax.tree_util."
            "register_pytree_node_class, register_dataclass or "
            "register_pytree_with_keys), then call register_batch_node."
        )
    if resize is not None:
        _check_resize(resize)
    if node_type in _BATCH_NODES and _BATCH_NODES[node_type] is not resize:
        jax.clear_caches()  # traces that applied the old entry
    _BATCH_NODES[node_type] = resize


# Types whose values are pytree leaves (or plain containers, split by their
# children): registering one declares nothing.
_LEAF_TYPES = (numbers.Number, str, bytes, np.ndarray, np.generic, jax.Array)


def _is_pytree_node(node_type: type) -> bool:
    """Whether JAX flattens values of ``node_type`` into children: a type
    registered with it (JAX's registry, where it can be read), or a
    NamedTuple (flattened as a tuple)."""
    if issubclass(node_type, tuple) and hasattr(node_type, "_fields"):
        return True
    from jax._src import tree_util  # no public registry to read

    registry = getattr(tree_util, "_registry", None)
    return registry is None or node_type in registry


def _check_resize(resize: Any) -> None:
    """``resize`` must be callable as ``resize(static, size)``."""
    if not callable(resize):
        raise TypeError(
            f"resize must be a function resize(static, size) -> static or None, "
            f"got {resize!r}."
        )
    try:
        inspect.signature(resize).bind(None, 1)
    except TypeError as error:
        raise TypeError(
            f"resize must take two positional arguments, resize(static, size), "
            f"and return the node's static data for `size` rows; "
            f"{getattr(resize, '__qualname__', resize)!r} cannot: {error}."
        ) from None
    except ValueError:  # no signature to read (a C function): called as is
        return


def resized_treedef(tree: PyTree, size: int, from_size: int | None = None) -> PyTree:
    """``tree``'s structure with the static data of every node registered with
    a ``resize`` (:func:`register_batch_node`) resized to ``size`` rows.

    ``from_size`` is the rows the static data says now (by default the
    leaves' leading size). A ``resize`` that leaves a static ``from_size`` in
    place of ``size`` (it held ``from_size`` and does not hold ``size``) is
    refused.

    Raises:
      ValueError: naming the node type and both sizes, for such a ``resize``.
    """
    if from_size is None:
        from_size = np.shape(jax.tree.leaves(tree)[0])[0]

    def resized(treedef: Any) -> PyTree:
        if jax.tree_util.treedef_is_leaf(treedef):
            return treedef
        node_type, static = treedef.node_data()
        resize = _BATCH_NODES.get(node_type)
        if resize is not None:
            new_static = resize(static, size)
            _check_resized(node_type, static, new_static, from_size, size)
            static = new_static
        children = [resized(child) for child in treedef.children()]
        return jax.tree_util.PyTreeDef.from_node_data_and_children(
            jax.tree_util.default_registry, (node_type, static), children
        )

    return resized(jax.tree.structure(tree))


def _check_resized(
    node_type: type, static: Any, new_static: Any, from_size: int, size: int
) -> None:
    if size == from_size or not _holds_size(static, from_size):
        return
    if _holds_size(new_static, size):
        return
    raise ValueError(
        f"The resize registered for {node_type.__name__} "
        f"(jaxaccum.register_batch_node) was asked for the static data of "
        f"{size} rows, from static data of {from_size} rows ({static!r}), and "
        f"returned {new_static!r}, which does not hold {size}: the model would "
        f"see {size} rows labelled otherwise. Make resize(static, size) return "
        "the static data with its batch size set to `size`."
    )


def relabelled(tree: PyTree, from_size: int) -> PyTree:
    """``tree`` with its registered nodes' static data resized from
    ``from_size`` rows to the rows its leaves have (a device's share of a
    batch under ``shard_map``)."""
    leaves = jax.tree.leaves(tree)
    size = np.shape(leaves[0])[0]
    if size == from_size:
        return tree
    return jax.tree.unflatten(resized_treedef(tree, size, from_size), leaves)


def _int_value(static: Any) -> int | None:
    """``static`` as an int if it is one: a Python, NumPy or concrete JAX
    integer scalar (not a bool); else None."""
    if isinstance(static, bool | np.bool_):
        return None
    if isinstance(static, int | np.integer):
        return int(static)
    if (
        isinstance(static, np.ndarray | jax.Array)
        and not isinstance(static, jax.core.Tracer)
        and static.shape == ()
        and jnp.issubdtype(static.dtype, jnp.integer)
    ):
        return int(static)
    return None


def _holds_size(static: Any, size: int, depth: int = 4) -> bool:
    """Whether ``static`` (a node's flattening data) holds the int ``size``,
    looking through containers and dataclass fields (an axis ``("batch", 32)``,
    ``Axis(name="batch", size=32)``)."""
    number = _int_value(static)
    if number is not None:
        return number == size
    if depth == 0:
        return False
    if dataclasses.is_dataclass(static) and not isinstance(static, type):
        items: Any = [getattr(static, f.name) for f in dataclasses.fields(static)]
    elif isinstance(static, dict):
        items = [*static.keys(), *static.values()]
    elif isinstance(static, tuple | list | set | frozenset):
        items = static
    else:
        return False
    return any(_holds_size(item, size, depth - 1) for item in items)


def check_static_sizes(batches: Sequence[tuple[str, Any]], size: int) -> None:
    """Refuses batch pytree nodes whose static data holds the batch size.

    Such a node (haliax's ``NamedArray``, whose axes say ``Batch size=32``) is
    split like any pytree: its arrays are cut into micro-batches, but its static
    data is not, so the model later sees arrays of ``B / N`` rows labelled
    ``B``. jaxaccum cannot know what the static data means, so it refuses them
    unless their type is registered with :func:`register_batch_node`.

    Raises:
      ValueError: naming the node, its type, its static data and the fix.
    """

    def check(prefix: str, path: tuple, node: Any) -> None:
        flat = jax.tree_util.default_registry.flatten_one_level_with_keys(node)
        if flat is None:
            return  # a leaf
        children, static = flat
        # A plain container's data is its keys, a namedtuple's is its type.
        declared = isinstance(node, _PLAIN_NODES) or type(node) in _BATCH_NODES
        if not declared and _holds_size(static, size):
            name = type(node).__name__
            raise ValueError(
                f"Batch node {_label(prefix, path)} is a {name} whose static "
                f"(non-array) data holds the batch size {size}: {static!r}. "
                "Splitting it into micro-batches would cut its arrays but not "
                "that size, so the model would see mislabelled micro-batches. "
                f"Declare how a {name} splits with jaxaccum.register_batch_node("
                f"{name}, resize) (resize(static, size) returns its static data "
                f"for `size` rows), or jaxaccum.register_batch_node({name}) if "
                "that number is not a batch size; or pass the raw arrays as the "
                "batch and wrap them inside the loss."
            )
        for key, child in children:
            check(prefix, (*path, key), child)

    for prefix, batch in batches:
        check(prefix, (), batch)


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
                    f"Batch leaf {_label(prefix, path)} is a scalar (shape ()); "
                    "every leaf of a batch argument needs a leading batch axis. "
                    "Pass per-batch constants as a non-batch argument instead."
                )
            sizes[_label(prefix, path)] = shape[0]
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
) -> Split:
    """Returns the :class:`Split` of a batch, checking that N divides it.

    With ``pad`` a batch that N does not divide is padded up to the next
    multiple (``N * ceil(B / N)``, or ``microbatch_size * ceil(B / size)``).
    """
    if microbatch_size is not None:
        num = -(-batch_size // microbatch_size)
        if batch_size % microbatch_size and not pad:
            raise ValueError(
                f"Batch size {batch_size} is not divisible by "
                f"microbatch_size={microbatch_size}. Micro-batch sizes that "
                f"divide it: {divisors(batch_size)}; or pass pad=True (with "
                "reduction='weighted' or 'sum') to pad the last micro-batches."
            )
        return Split(num, batch_size, num * microbatch_size)
    assert num_microbatches is not None
    if batch_size % num_microbatches and not pad:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by "
            f"num_microbatches={num_microbatches}, so the micro-batches would "
            f"have unequal sizes. Choose num_microbatches from "
            f"{divisors(batch_size)}, change the batch size, or pass pad=True "
            "(with reduction='weighted' or 'sum') to pad with masked rows."
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


def _axis0_devices(leaf: PyTree) -> tuple[tuple[str, ...], int]:
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
            names, devices = _axis0_devices(leaf)
            if rows % devices:
                local = batch_size // devices
                raise ValueError(
                    f"Batch leaf {_label(prefix, path)} has {batch_size} rows "
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
    resolve_num_microbatches(size, num_microbatches, None)
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
