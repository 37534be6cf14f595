"""Data parallel accumulation with one all-reduce per window.

``jaxaccum.value_and_grad`` on a batch sharded over devices on axis 0 already
keeps every micro-batch on the devices that hold its rows (the strided split),
but XLA then all-reduces the gradient once per micro-batch, inside the loop.
:func:`shard_value_and_grad` runs the window under ``jax.shard_map`` instead:
each device accumulates the gradient of its own rows over all micro-batches and
a single all-reduce after the loop combines them. The result is the same
full-batch gradient; ``N - 1`` of the ``N`` gradient all-reduces are saved.

Works across hosts with JAX's multi-controller runtime: each process feeds its
own rows with :func:`shard_batch` (``jax.make_array_from_process_local_data``).
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from typing_extensions import Unpack

from jaxaccum._shard._shard_map import manual_over, rows_over_devices, run_per_device
from jaxaccum._types import Fun, PyTree, ShardKwargs
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window import _split
from jaxaccum._window._call_checks import check_arg_count
from jaxaccum._window._fsdp import shard_plan
from jaxaccum._window._mesh import check_callable_mesh, check_mesh_type
from jaxaccum._window._spec import WindowSpec

DataAxis = str | Sequence[str]


def data_axes_of(data_axis: DataAxis) -> tuple[str, ...]:
    if isinstance(data_axis, str):
        return (data_axis,)
    axes = tuple(data_axis) if isinstance(data_axis, Sequence) else ()
    if not axes or not all(isinstance(axis, str) for axis in axes):
        raise TypeError(
            "data_axis must be a mesh axis name or a sequence of them, got "
            f"{data_axis!r}."
        )
    return axes


def resolve_mesh(
    mesh: Mesh | AbstractMesh | None,
    data_axes: tuple[str, ...],
    context_mesh: Callable[[], Any],
) -> PyTree:
    """``mesh``, else ``context_mesh()`` (the one set with ``jax.set_mesh``),
    checked to be a mesh with ``data_axes``."""
    check_mesh_type(mesh, f"jax.make_mesh((jax.device_count(),), {data_axes!r})")
    if mesh is None:
        mesh = context_mesh()
    if mesh.empty:
        raise ValueError(
            "No mesh: pass mesh=, or call inside `with jax.set_mesh(mesh):`; "
            f"for example jax.make_mesh((jax.device_count(),), {data_axes!r})."
        )
    missing = [axis for axis in data_axes if axis not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"data_axis {missing} not in the mesh, whose axes are "
            f"{mesh.axis_names} with sizes {dict(mesh.shape)}. Pass the name of "
            "the axis the batch is sharded over as data_axis."
        )
    return mesh


def call_mesh(mesh: Mesh | AbstractMesh | None, data_axes: tuple[str, ...]) -> Any:
    """The mesh a window per device runs on in this call: the context's
    where the caller's ``shard_map`` is already manual over ``data_axes``
    (the rows given are the device's), else :func:`resolve_mesh`'s, an
    ``AbstractMesh`` only where it is the one set with ``jax.set_mesh``."""
    context = jax.sharding.get_abstract_mesh()
    if manual_over(context, data_axes):
        resolve_mesh(mesh, data_axes, lambda: context)
        return context
    check_callable_mesh(mesh)
    return resolve_mesh(mesh, data_axes, lambda: context)


def shard_batch(
    local_batch: Any,
    mesh: Mesh | None = None,
    *,
    data_axis: DataAxis = "data",
) -> PyTree:
    """Makes a global batch, sharded on axis 0 over ``data_axis``, from local rows.

    Each process passes the rows it loaded (``B / num_processes`` of them, the
    same count in every process); the result is one global array per leaf of
    ``B`` rows, process ``p``'s rows being rows ``[p B / P, (p + 1) B / P)``
    (``jax.make_array_from_process_local_data``). With a single process the
    local batch is the whole batch.

    Args:
      local_batch: a pytree of arrays (NumPy or JAX) with a leading batch axis.
      mesh: a ``jax.sharding.Mesh``; by default the one set with
        ``jax.set_mesh``.
      data_axis: the mesh axis (or axes) to shard the batch's axis 0 over.

    Returns:
      A pytree like ``local_batch`` of global ``jax.Array`` s.

    Examples:
      >>> import jax, numpy as np
      >>> import jaxaccum
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> batch = jaxaccum.shard_batch({"x": np.ones((8, 3))}, mesh)
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((8, 3), P('data',))
    """
    data_axes = data_axes_of(data_axis)
    mesh = resolve_mesh(mesh, data_axes, jax.sharding.get_mesh)
    spec = PartitionSpec(data_axes[0] if len(data_axes) == 1 else data_axes)
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch
    )


class _ShardOptions(ShardKwargs, total=False):
    """ShardKwargs and shard_value_and_grad's own keywords: the options an
    unknown keyword's message lists (and suggests, data_axis for data_axes)."""

    mesh: Mesh | AbstractMesh | None
    data_axis: DataAxis


# value_and_grad's options that a window under shard_map does not take.
_NOT_SHARDED = {
    "state_argnums": "carried state such as BatchNorm statistics would be per "
    "device; use jaxaccum.value_and_grad, whose micro-batch statistics span all "
    "devices.",
    "report_finite": "pass report_stats=True: its WindowStats holds the finite "
    "flags (microbatch_finite, finite).",
    "masked": "use jaxaccum.value_and_grad(..., masked=True) on the sharded "
    "batch under jit.",
}


def shard_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    data_axis: DataAxis = "data",
    **keywords: Unpack[ShardKwargs],
) -> Fun:
    """Returns :func:`jaxaccum.value_and_grad`'s step, all-reducing once per window.

    Each device accumulates its rows' micro-batches under ``jax.shard_map``, then
    one ``psum``. Guide: [Data parallel and sharded](../guides/distributed.md).

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      num_microbatches: ``N``, micro-batches per window (each spread over all
        ``D`` devices of ``data_axis``); must split each device's rows equally.
      mesh: a ``jax.sharding.Mesh`` (an ``AbstractMesh`` only inside
        ``jax.set_mesh``); by default the one set with ``jax.set_mesh``. Inside
        the caller's ``jax.shard_map`` over ``data_axis``: each device's rows.
      data_axis: the mesh axis (or axes) the batch is sharded over on axis 0.
      **keywords: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch over all ``D`` devices.
      argnums: as for :func:`jaxaccum.value_and_grad`.
      batch_argnums: as there; sharded over ``data_axis`` on axis 0.
      key_argnums: PRNG keys, folded with the device's index, split per micro-batch.
      has_aux: as for :func:`jaxaccum.value_and_grad`.
      reduction: as for :func:`jaxaccum.value_and_grad`, over all devices.
      aux_reduction: ``"mean"`` or ``"sum"`` (or a pytree prefix of them).
      accum_dtype: as for :func:`jaxaccum.value_and_grad`; reductions run in it.
      pad: as for :func:`jaxaccum.value_and_grad`, per device.
      unroll: passed to ``jax.lax.scan``.
      remat: as for :func:`jaxaccum.value_and_grad`.
      conv_layout: as there.
      report_stats: also return a :class:`jaxaccum.WindowStats` (local norms).
      param_gather: ``"auto"``, ``"window"`` or ``"microbatch"`` (auto's):
        when FSDP parameters are all-gathered (once with ``axis_name``).
      grad_reduce: ``"auto"``, ``"window"`` or ``"microbatch"``: when gradients
        are reduced (``"auto"``: every micro-batch for FSDP leaves, else once).
      gather_dtype: the dtype FSDP shards are all-gathered in.
      loss_scale: as there; the window is finite on every device or on none.
      axis_name: as there; a collective over ``(data_axis, axis_name)``, or
        over ``data_axis`` as ``axis_name`` (joined), spans devices and micro-batches.
      axis_layout: as there (``"contiguous"``: member ``d N + k``, block ``d N + k``).

    Returns:
      A function with ``fun``'s positional signature returning what
      :func:`jaxaccum.value_and_grad`'s does (no ``new_state``, no finite
      report): gradients sharded as the parameters, the rest replicated.

    Raises:
      TypeError: for ``state_argnums``, ``report_finite``, ``masked``, an
        unknown keyword, or a ``mesh`` that is not one; ValueError: without
        a mesh, a ``data_axis`` not in it, or an ``AbstractMesh`` not set.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxaccum
      >>> def loss(params, batch):
      ...     return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> batch = jaxaccum.shard_batch(
      ...     {"x": np.ones((8, 3), np.float32), "y": np.zeros(8, np.float32)}, mesh)
      >>> step = jax.jit(jaxaccum.shard_value_and_grad(loss, 4, mesh=mesh))
      >>> step(jnp.ones(3), batch)
      (Array(9., dtype=float32), Array([6., 6., 6.], dtype=float32))
    """
    # Built once here so that bad options fail at construction, as they do for
    # value_and_grad; the per-device micro-batch size and the parameters'
    # shardings are known only per call.
    check_mesh_type(mesh, "jax.make_mesh((jax.device_count(),), ('data',))")
    # data_axes set after the keywords' check, so that a data_axes= slip is
    # an unknown keyword (did you mean data_axis?).
    options = WindowSpec.create(
        "shard_value_and_grad",
        num_microbatches,
        keywords,
        _ShardOptions,
        refused=_NOT_SHARDED,
    ).resharded(data_axes=data_axes_of(data_axis))

    @functools.wraps(fun)
    def accumulated(*args: PyTree, **kwargs: PyTree) -> PyTree:
        check_arg_count(args, options)
        device_mesh = call_mesh(mesh, options.data_axes)
        diff_args = tuple(args[num] for num in options.diff_nums)
        batch_size = rows_over_devices(args, options, device_mesh)
        call_options = per_device_options(options, batch_size, device_mesh).resharded(
            param_specs=_param_specs_of(diff_args, options.data_axes)
        )
        shards = shard_plan(call_options)
        assert shards is not None  # data_axes is never empty here
        return run_per_device(
            make_accumulated(fun, call_options),
            args,
            kwargs,
            options,
            device_mesh,
            shards.data_specs(diff_args),
        )

    return accumulated


def _param_specs_of(diff_args: tuple, data_axes: tuple[str, ...]) -> tuple:
    """Per differentiated leaf, its Explicit ``PartitionSpec`` (``P()`` on an
    Auto mesh, where it is not known); checked to shard over ``data_axes``
    on at most one dimension, all of them in order, alone."""
    specs = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(diff_args):
        sharding = _split.explicit_sharding(jax.typeof(leaf))
        spec = PartitionSpec() if sharding is None else sharding.spec
        found = [
            names
            for names in (_split.spec_names(entry) for entry in spec)
            if set(names) & set(data_axes)
        ]
        if found and found != [data_axes]:
            label = f"args[argnums]{jax.tree_util.keystr(path[1:])}"
            raise ValueError(
                f"Parameter {label} of shape {jnp.shape(leaf)} is sharded "
                f"{spec}; shard_value_and_grad shards a parameter over the data "
                f"axes {data_axes} on one dimension, over all of them in that "
                "order and no other axis on that dimension (e.g. P('data', "
                "'model') for a 2-D weight). Reshard it that way, or use "
                "jaxaccum.value_and_grad, which takes any sharding."
            )
        specs.append(spec)
    return tuple(specs)


def per_device_options(
    options: WindowSpec, batch_size: int, mesh: Any, *, can_pad: bool = True
) -> WindowSpec:
    """The options of one device's window: its share of the micro-batch size
    (``can_pad``: whether the front end takes ``pad``, for the hint)."""
    num_devices = math.prod(mesh.shape[axis] for axis in options.data_axes)
    local_microbatch_size = _local_split(batch_size, num_devices, options, can_pad)
    if local_microbatch_size is None:
        return options
    return dataclasses.replace(options, microbatch_size=local_microbatch_size)


def _local_split(
    batch_size: int, num_devices: int, options: WindowSpec, can_pad: bool = True
) -> int | None:
    """Checks the per-device split; returns the per-device micro-batch size
    (None when the split is given as ``num_microbatches``)."""
    or_pad = ", or pad=True (with reduction='weighted' or 'sum')" if can_pad else ""
    num_microbatches, microbatch_size = (
        options.num_microbatches,
        options.microbatch_size,
    )
    pad = options.pad
    where = f"{num_devices} devices on mesh axes {options.data_axes}"
    if batch_size % num_devices:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by the {where}; every "
            f"device needs the same number of rows. Use a multiple of "
            f"{num_devices}."
        )
    local_size = batch_size // num_devices
    if microbatch_size is not None:
        if microbatch_size % num_devices:
            raise ValueError(
                f"microbatch_size={microbatch_size} counts examples over all "
                f"{where}, so it must be a multiple of {num_devices}; each "
                "device takes microbatch_size / devices rows per micro-batch."
            )
        if local_size % (microbatch_size // num_devices) and not pad:
            raise ValueError(
                f"Batch size {batch_size} over {where} is {local_size} rows per "
                f"device, which microbatch_size={microbatch_size} "
                f"({microbatch_size // num_devices} per device) does not divide. "
                "Use a micro-batch size that divides the batch size by a "
                f"multiple of the device count{or_pad}."
            )
        return microbatch_size // num_devices
    assert num_microbatches is not None  # WindowSpec sets exactly one
    if local_size % num_microbatches and not pad:
        raise ValueError(
            f"Batch size {batch_size} over {where} is {local_size} rows per "
            f"device, which num_microbatches={num_microbatches} does not divide: "
            "each device splits its own rows into the micro-batches. Use "
            f"num_microbatches from {_split.divisors(local_size)}, or a batch "
            f"size that is a multiple of {num_devices * num_microbatches}{or_pad}."
        )
    return None
