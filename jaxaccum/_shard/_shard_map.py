"""One device's window under ``jax.shard_map``, manual over the data axes: the
arguments each device sees, the specs in and out, and Explicit mesh axes; or,
inside a caller's ``shard_map`` already manual over them, on the rows given."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxaccum._types import Fun, PyTree
from jaxaccum._window import _batch_nodes, _split
from jaxaccum._window._spec import WindowSpec


class Frozen(NamedTuple):
    """The arguments not mapped by role (positional ones outside argnums,
    batch_argnums and key_argnums; keyword ones), split into the ``jax.Array``
    leaves that enter the ``shard_map`` as arguments (it refuses to close over
    an array sharded on an Explicit axis, even replicated) and the others,
    closed over.

    Attributes:
      arrays: the array leaves, in flattening order.
      leaves: every leaf of ``(positional, kwargs)``, mapped positions None.
      treedef: the structure of ``(positional, kwargs)``.
    """

    arrays: list
    leaves: list
    treedef: Any

    @classmethod
    def of(cls, args: tuple, kwargs: dict, mapped_nums: tuple[int, ...]) -> "Frozen":
        positional = tuple(
            None if num in mapped_nums else arg for num, arg in enumerate(args)
        )
        leaves, treedef = jax.tree.flatten((positional, kwargs))
        arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
        return cls(arrays, leaves, treedef)

    def rebuild(self, arrays: list) -> tuple[list, dict]:
        """``(positional, kwargs)`` with ``arrays`` in place of the array
        leaves (mapped positions None, for the caller to fill)."""
        replacements = iter(arrays)
        leaves = [
            next(replacements) if isinstance(leaf, jax.Array) else leaf
            for leaf in self.leaves
        ]
        positional, kwargs = jax.tree.unflatten(self.treedef, leaves)
        return list(positional), kwargs


def run_per_device(
    per_device: Fun,
    args: tuple,
    kwargs: dict,
    options: WindowSpec,
    mesh: Any,
    grad_specs: tuple,
) -> PyTree:
    """``per_device(*args, **kwargs)`` run on each device of ``mesh`` under
    ``shard_map``, manual over ``options.data_axes``: the batch arguments are
    the device's rows (their registered nodes labelled so), the parameters
    sharded as ``grad_specs`` says (their gradients too), the rest replicated.
    The one way a window runs per device (shard_value_and_grad's, and
    cached_value_and_grad's with a mesh). Inside a caller's ``shard_map``
    already manual over the data axes, ``per_device`` runs on the rows given
    (``mesh`` is then the context's)."""
    if manual_over(mesh, options.data_axes):
        if options.axis_name is not None:
            raise ValueError(
                "axis_name inside the caller's own shard_map: its varying-axis "
                "types refuse a collective over a data axis and the window's "
                "together. Call shard_value_and_grad outside the shard_map."
            )
        check_given_rows(args, options)
        return per_device(*args, **kwargs)
    mapped_nums = tuple(
        sorted(options.diff_nums + options.batch_nums + options.key_nums)
    )
    batch_size = _split.batch_size_of(
        [(f"args[{i}]", args[i]) for i in options.batch_nums]
    )
    frozen = Frozen.of(args, kwargs, mapped_nums)

    def on_device(mapped: tuple, frozen_arrays: list) -> PyTree:
        call_args, call_kwargs = frozen.rebuild(frozen_arrays)
        for num, value in zip(mapped_nums, mapped, strict=True):
            # A device's rows, their registered nodes labelled so.
            is_batch = num in options.batch_nums
            call_args[num] = (
                _batch_nodes.relabelled(value, batch_size) if is_batch else value
            )
        return per_device(*call_args, **call_kwargs)

    diff_args = tuple(args[num] for num in options.diff_nums)
    step = shard_mapped(on_device, mapped_nums, options, mesh, grad_specs)
    step = auto_model_axes(step, diff_args, options, mesh)
    # Under jit, Auto-sharded inputs not yet sharded as in_specs says are
    # resharded (an eager shard_map refuses them); in the caller's jit, this
    # jit is inlined.
    mapped = on_mesh(tuple(args[num] for num in mapped_nums), mesh)
    return jax.jit(step)(mapped, on_mesh(frozen.arrays, mesh))


def on_mesh(tree: PyTree, mesh: Any) -> PyTree:
    """``tree`` with the leaves on no mesh (a single device's arrays, NumPy
    ones) replicated on ``mesh`` if it is a concrete Mesh with Explicit axes:
    outside ``jax.set_mesh`` nothing else tells the step's ``jit`` (or the
    caller's) which devices the mesh in its types is on."""
    if not isinstance(mesh, Mesh) or AxisType.Explicit not in mesh.axis_types:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda leaf: (
            jax.device_put(leaf, replicated)
            if jax.typeof(leaf).sharding.mesh.empty
            else leaf
        ),
        tree,
    )


def manual_over(mesh: Any, data_axes: tuple[str, ...]) -> bool:
    """Whether ``mesh`` (the context's, in a caller's ``shard_map``) is
    manual over every data axis.

    Raises:
      ValueError: where it is manual over some of them only.
    """
    if mesh.empty:
        return False
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    manual = [axis for axis in data_axes if kinds.get(axis) == AxisType.Manual]
    if manual and len(manual) < len(data_axes):
        raise ValueError(
            f"data_axis {data_axes} is partly manual here: the enclosing "
            f"shard_map is manual over {tuple(manual)} only. Call inside a "
            "shard_map manual over all of them (axis_names=), or outside it, "
            "or pass data_axis= the manual ones."
        )
    return bool(manual)


def rows_over_devices(args: tuple, options: WindowSpec, mesh: Any) -> int:
    """The batch's rows over all devices of the data axes: the batch
    arguments' size, times the devices where each is given a device's rows
    (:func:`manual_over`)."""
    size = _split.batch_size_of([(f"args[{i}]", args[i]) for i in options.batch_nums])
    if manual_over(mesh, options.data_axes):
        size *= math.prod(mesh.shape[axis] for axis in options.data_axes)
    return size


def check_given_rows(args: tuple, options: WindowSpec) -> None:
    """In a caller's ``shard_map`` manual over the data axes: the batch
    leaves vary over them (each device's own rows) and the parameters do not
    (their gradients are summed over the devices).

    Raises:
      ValueError: naming the leaf, how it varies, and what to pass.
    """
    axes = options.data_axes
    entry = axes[0] if len(axes) == 1 else axes
    for num in options.batch_nums + options.diff_nums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[num]):
            varying = tuple(
                axis
                for axis in axes
                if axis in jax.typeof(leaf).manual_axis_type.varying
            )
            label = (
                f"args[{num}]{jax.tree_util.keystr(path)} of shape {jnp.shape(leaf)}"
            )
            if num in options.batch_nums and varying != axes:
                raise ValueError(
                    f"{label} is the same on every device of {axes} in the "
                    "enclosing shard_map, which is manual over them: the window "
                    "takes each device's own rows there. Give the batch "
                    f"in_specs=P({entry!r}) (with check_vma=True, the default, "
                    "which types its rows so)."
                )
            if num in options.diff_nums and varying:
                raise ValueError(
                    f"{label} varies over {varying} in the enclosing shard_map: "
                    "the window sums each parameter's gradient over the data "
                    "axes, so it takes parameters that do not. Give it "
                    "in_specs=P() (replicated), or call the step outside the "
                    "shard_map, with mesh=, for parameters sharded over the "
                    "data axes."
                )


def shard_mapped(
    on_device: Fun,
    mapped_nums: tuple[int, ...],
    options: WindowSpec,
    mesh: Any,
    param_specs: tuple,
) -> Fun:
    """``on_device(mapped, frozen_arrays)`` under ``shard_map``: batch
    arguments split over the data axes, parameters as ``param_specs`` say
    (their gradients too), keys and frozen arrays replicated over them."""
    data_axes = options.data_axes
    batch_entry = data_axes[0] if len(data_axes) == 1 else data_axes
    specs = dict(zip(options.diff_nums, param_specs, strict=True))
    for num in options.batch_nums:
        specs[num] = PartitionSpec(batch_entry)

    def step(mapped: tuple, frozen_arrays: list) -> PyTree:
        # The context mesh: under auto_model_axes its non-data axes are Auto.
        context = jax.sharding.get_abstract_mesh()
        mapped_specs = tuple(specs.get(num, PartitionSpec()) for num in mapped_nums)
        mapped_step = jax.shard_map(
            on_device,
            mesh=mesh if context.empty else context,
            in_specs=(mapped_specs, PartitionSpec()),
            out_specs=out_specs(options, param_specs),
            axis_names=set(data_axes),
            # A window over a named axis traces collectives over a data axis
            # and the window's together, which JAX's varying-axis types do not
            # let one name; it sums its gradients over the devices itself.
            check_vma=options.axis_name is None,
        )
        fitted = tuple(
            value
            if num in options.diff_nums
            else fit_explicit(value, mesh, data_axes, num in options.batch_nums)
            for num, value in zip(mapped_nums, mapped, strict=True)
        )
        return mapped_step(
            fitted, fit_explicit(frozen_arrays, mesh, data_axes, split_rows=False)
        )

    return step


def out_specs(options: WindowSpec, grad_specs: tuple) -> PyTree:
    """Specs of the accumulated function's outputs: ``grad_specs`` (one tree
    per differentiated argument) for the gradients, replicated otherwise."""
    grads = grad_specs[0] if isinstance(options.argnums, int) else grad_specs
    value = (PartitionSpec(), PartitionSpec()) if options.has_aux else PartitionSpec()
    out_specs = (value, grads)
    return (out_specs, PartitionSpec()) if options.reports else out_specs


def auto_model_axes(step: Fun, diff_args: tuple, options: WindowSpec, mesh: Any) -> Fun:
    """Runs ``step`` with the Explicit mesh axes other than the data axes made
    Auto (``jax.sharding.auto_axes``); the gradients leave sharded as the
    parameters are.

    A ``shard_map`` manual over the data axes all-gathers, at its boundary,
    every input sharded over an Explicit axis it leaves alone, and slices it
    again inside (on JAX 0.10.2 a tensor-parallel weight is moved whole at
    every call). Over Auto axes it keeps the sharding and does not.
    """
    model_axes = tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit and name not in options.data_axes
    )
    if not model_axes:
        return step
    param_specs = jax.tree.map(lambda leaf: jax.typeof(leaf).sharding.spec, diff_args)
    auto_step = jax.sharding.auto_axes(
        step, axes=model_axes, out_sharding=out_specs(options, param_specs)
    )

    def in_mesh(*step_args: PyTree) -> Any:
        abstract = getattr(mesh, "abstract_mesh", mesh)
        with jax.sharding.use_abstract_mesh(abstract):
            return auto_step(*step_args)

    return in_mesh


def fit_explicit(
    tree: PyTree, mesh: Any, data_axes: tuple[str, ...], split_rows: bool
) -> Any:
    """Reshards batch, key and frozen leaves to what the ``shard_map``
    in_specs expect, if Explicit.

    Over Explicit mesh axes ``shard_map`` does not reshard its inputs: batch
    leaves must be sharded over exactly ``data_axes`` on axis 0, and keys and
    frozen arrays not over them (gathered whole). Other mesh axes are kept.
    """
    if all(
        mesh.axis_types[mesh.axis_names.index(a)] != AxisType.Explicit
        for a in data_axes
    ):
        return tree

    def without_data_axes(entry: Any) -> PyTree:
        kept = tuple(name for name in _split.spec_names(entry) if name not in data_axes)
        return kept[0] if len(kept) == 1 else kept or None

    def fit(leaf: PyTree) -> Any:
        spec = tuple(jax.typeof(leaf).sharding.spec)
        spec += (None,) * (jnp.ndim(leaf) - len(spec))
        wanted = [without_data_axes(entry) for entry in spec]
        if split_rows:
            wanted[0] = data_axes[0] if len(data_axes) == 1 else data_axes
        if tuple(wanted) == spec:
            return leaf
        return jax.sharding.reshard(leaf, NamedSharding(mesh, PartitionSpec(*wanted)))

    return jax.tree.map(fit, tree)
