"""Batch nodes: pytree nodes of a batch whose static data holds its size
(:func:`register_batch_node`), resized to a micro-batch's rows."""

import collections
import dataclasses
import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._types import PyTree


def label(prefix: str, path: tuple) -> str:
    return prefix + jax.tree_util.keystr(path)


# Containers whose flattening data is their keys or type, never a size.
PLAIN_NODES = (tuple, list, dict, collections.OrderedDict, collections.defaultdict)


# register_batch_node's registry: node type -> how its static data is resized
# to a micro-batch's rows (None: it holds no batch size).
BATCH_NODES: dict[type, Callable[[Any, int], Any] | None] = {}


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
    if issubclass(node_type, LEAF_TYPES):
        raise TypeError(
            f"node_type {node_type.__name__} is a leaf type, not a pytree node: "
            "jaxaccum splits its values by their leading axis already. Register "
            "the pytree node class whose static (tree_flatten aux) data holds "
            "the batch size."
        )
    if not is_pytree_node(node_type):
        raise TypeError(
            f"node_type {node_type.__name__} is not a pytree node type: JAX "
            "takes its values as leaves, so nothing registered for it could "
            "apply. Register it with JAX first (jax.tree_util."
            "register_pytree_node_class, register_dataclass or "
            "register_pytree_with_keys), then call register_batch_node."
        )
    if resize is not None:
        check_resize(resize)
    if node_type in BATCH_NODES and BATCH_NODES[node_type] is not resize:
        jax.clear_caches()  # traces that applied the old entry
    BATCH_NODES[node_type] = resize


# Types whose values are pytree leaves (or plain containers, split by their
# children): registering one declares nothing.
LEAF_TYPES = (numbers.Number, str, bytes, np.ndarray, np.generic, jax.Array)


def is_pytree_node(node_type: type) -> bool:
    """Whether JAX flattens values of ``node_type`` into children: a type
    registered with it (JAX's registry, where it can be read), or a
    NamedTuple (flattened as a tuple)."""
    if issubclass(node_type, tuple) and hasattr(node_type, "_fields"):
        return True
    from jax._src import tree_util  # no public registry to read

    registry = getattr(tree_util, "_registry", None)
    return registry is None or node_type in registry


def check_resize(resize: Any) -> None:
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
        resize = BATCH_NODES.get(node_type)
        if resize is not None:
            new_static = resize(static, size)
            check_resized(node_type, static, new_static, from_size, size)
            static = new_static
        children = [resized(child) for child in treedef.children()]
        return jax.tree_util.PyTreeDef.from_node_data_and_children(
            jax.tree_util.default_registry, (node_type, static), children
        )

    return resized(jax.tree.structure(tree))


def check_resized(
    node_type: type, static: Any, new_static: Any, from_size: int, size: int
) -> None:
    if size == from_size or not holds_size(static, from_size):
        return
    if holds_size(new_static, size):
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


def int_value(static: Any) -> int | None:
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


def holds_size(static: Any, size: int, depth: int = 4) -> bool:
    """Whether ``static`` (a node's flattening data) holds the int ``size``,
    looking through containers and dataclass fields (an axis ``("batch", 32)``,
    ``Axis(name="batch", size=32)``)."""
    number = int_value(static)
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
    return any(holds_size(item, size, depth - 1) for item in items)


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
        declared = isinstance(node, PLAIN_NODES) or type(node) in BATCH_NODES
        if not declared and holds_size(static, size):
            name = type(node).__name__
            raise ValueError(
                f"Batch node {label(prefix, path)} is a {name} whose static "
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
