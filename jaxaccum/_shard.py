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
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxaccum import _split
from jaxaccum._options import AccumOptions, ArgNums, Reduction
from jaxaccum._value_and_grad import check_arg_count, make_accumulated

DataAxis = str | Sequence[str]


def _data_axes(data_axis: DataAxis) -> tuple[str, ...]:
    if isinstance(data_axis, str):
        return (data_axis,)
    axes = tuple(data_axis) if isinstance(data_axis, Sequence) else ()
    if not axes or not all(isinstance(axis, str) for axis in axes):
        raise TypeError(
            "data_axis must be a mesh axis name or a sequence of them, got "
            f"{data_axis!r}."
        )
    return axes


def _resolve_mesh(
    mesh: Mesh | AbstractMesh | None,
    data_axes: tuple[str, ...],
    context_mesh: Callable[[], Any],
) -> Any:
    """``mesh``, else ``context_mesh()`` (the one set with ``jax.set_mesh``)."""
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


def shard_batch(
    local_batch: Any,
    mesh: Mesh | None = None,
    *,
    data_axis: DataAxis = "data",
) -> Any:
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

    Example:
      >>> import jax, numpy as np
      >>> import jaxaccum
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> batch = jaxaccum.shard_batch({"x": np.ones((8, 3))}, mesh)
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((8, 3), P('data',))
    """
    data_axes = _data_axes(data_axis)
    mesh = _resolve_mesh(mesh, data_axes, jax.sharding.get_mesh)
    spec = PartitionSpec(data_axes[0] if len(data_axes) == 1 else data_axes)
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch
    )


def shard_value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    data_axis: DataAxis = "data",
    microbatch_size: int | None = None,
    argnums: ArgNums = 0,
    batch_argnums: ArgNums = 1,
    key_argnums: ArgNums = (),
    has_aux: bool = False,
    reduction: Reduction = "mean",
    aux_reduction: Any = "mean",
    accum_dtype: Any = jnp.float32,
    pad: bool = False,
    unroll: int | bool = 1,
    remat: bool | Callable[..., Any] = False,
    report_stats: bool = False,
) -> Callable[..., Any]:
    """:func:`jaxaccum.value_and_grad` with one gradient all-reduce per window.

    The window runs under ``jax.shard_map``, manual over ``data_axis``: each
    device splits its own rows of the batch into ``N`` strided micro-batches,
    accumulates the gradient sums (and loss and weight sums) of all of them,
    and one ``psum`` over ``data_axis`` after the loop combines the devices'
    sums, which are then normalised as in :func:`jaxaccum.value_and_grad`:

    * ``"mean"``: divided by ``N * D`` (``D`` devices on ``data_axis``, every
      device holding the same number of rows), the full-batch mean;
    * ``"weighted"``: divided by the weight summed over every micro-batch of
      every device, so the token-exact mean holds globally;
    * ``"sum"``: the global sum.

    Gradients equal the full-batch ones, as in :func:`jaxaccum.value_and_grad`,
    but XLA no longer all-reduces them once per micro-batch inside the loop.
    Mesh axes other than ``data_axis`` stay automatic (or explicit): parameters
    sharded over a model axis keep that sharding, and so do their gradients.

    Differences from :func:`jaxaccum.value_and_grad`, all because ``fun`` sees
    one device's rows at a time:

    * ``num_microbatches`` (or ``microbatch_size``, counted over all devices)
      must split each device's ``B / D`` rows into equal micro-batches;
    * ``aux_reduction`` is ``"mean"`` (averaged over micro-batches and
      devices: exact for per-example means such as accuracy) or ``"sum"``;
    * PRNG keys in ``key_argnums`` are folded with the device's index, then
      split into ``N``: devices draw independent randomness for their rows,
      so results equal the single-device ones in distribution, not bitwise;
    * carried state (``state_argnums``) is not supported: statistics such as
      BatchNorm's would be per device. Use :func:`jaxaccum.value_and_grad`,
      whose micro-batch statistics span all devices;
    * with ``pad``, each device pads its own rows.

    Arguments that are not differentiated, batch or key arguments (and keyword
    arguments) are passed to ``fun`` unchanged, closed over.

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      num_microbatches: ``N``, micro-batches per window (each spread over all
        devices).
      mesh: the device mesh; by default the one set with ``jax.set_mesh``.
      data_axis: the mesh axis (or axes) the batch is sharded over on axis 0.
      microbatch_size: examples per micro-batch, over all devices; instead of
        ``num_microbatches``. Must be a multiple of ``D``.
      argnums: as for :func:`jaxaccum.value_and_grad`.
      batch_argnums: as for :func:`jaxaccum.value_and_grad`; these arguments
        are sharded over ``data_axis`` on axis 0 (resharded if they are not).
      key_argnums: see above.
      has_aux: as for :func:`jaxaccum.value_and_grad`.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``, as for
        :func:`jaxaccum.value_and_grad`.
      aux_reduction: ``"mean"`` or ``"sum"``, or a pytree prefix of the aux
        output mapping leaves to them.
      accum_dtype: as for :func:`jaxaccum.value_and_grad`.
      pad: as for :func:`jaxaccum.value_and_grad`, per device.
      unroll: passed to ``jax.lax.scan``.
      remat: as for :func:`jaxaccum.value_and_grad`.
      report_stats: also return a :class:`jaxaccum.WindowStats`; the
        micro-batch norms are each device's local ones (``b = B / (N D)``),
        taken before the one deferred reduction.

    Returns:
      A function with ``fun``'s positional signature returning ``(value,
      grads)`` (``((value, aux), grads)`` with ``has_aux``; with
      ``report_stats``, ``(that, stats)``), replicated over ``data_axis``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import jaxaccum
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
    # value_and_grad; the per-device micro-batch size is known only per call.
    options = AccumOptions.from_arguments(
        {**locals(), "data_axes": _data_axes(data_axis)}
    )
    mapped_nums = tuple(
        sorted(options.diff_nums + options.batch_nums + options.key_nums)
    )

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> Any:
        check_arg_count(args, options)
        device_mesh = _resolve_mesh(
            mesh, options.data_axes, jax.sharding.get_abstract_mesh
        )
        per_device = make_accumulated(
            fun, _per_device_options(options, args, device_mesh)
        )

        def on_device(*mapped: Any) -> Any:
            call_args = list(args)
            for num, value in zip(mapped_nums, mapped, strict=True):
                call_args[num] = value
            return per_device(*call_args, **kwargs)

        step = _shard_map(on_device, mapped_nums, options, device_mesh)
        # Under jit, Auto-sharded inputs not yet sharded as in_specs says are
        # resharded (an eager shard_map refuses them); in the caller's jit,
        # this jit is inlined.
        return jax.jit(step)(*(args[num] for num in mapped_nums))

    return accumulated


def _per_device_options(options: AccumOptions, args: tuple, mesh: Any) -> AccumOptions:
    """The options of one device's window: its share of the micro-batch size."""
    num_devices = math.prod(mesh.shape[axis] for axis in options.data_axes)
    batch_size = _split.batch_size_of(
        [(f"args[{i}]", args[i]) for i in options.batch_nums]
    )
    local_microbatch_size = _local_split(batch_size, num_devices, options)
    if local_microbatch_size is None:
        return options
    return dataclasses.replace(options, microbatch_size=local_microbatch_size)


def _shard_map(
    on_device: Callable[..., Any],
    mapped_nums: tuple[int, ...],
    options: AccumOptions,
    mesh: Any,
) -> Callable[..., Any]:
    """``on_device`` under ``shard_map``: batch arguments split over the data
    axes, the differentiated and key arguments replicated over them."""
    data_axes = options.data_axes
    batch_entry = data_axes[0] if len(data_axes) == 1 else data_axes
    mapped_step = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=tuple(
            PartitionSpec(batch_entry) if num in options.batch_nums else PartitionSpec()
            for num in mapped_nums
        ),
        out_specs=PartitionSpec(),
        axis_names=set(data_axes),
    )

    def step(*mapped: Any) -> Any:
        return mapped_step(
            *(
                _fit_explicit(value, mesh, data_axes, num in options.batch_nums)
                for num, value in zip(mapped_nums, mapped, strict=True)
            )
        )

    return step


def _fit_explicit(
    tree: Any, mesh: Any, data_axes: tuple[str, ...], split_rows: bool
) -> Any:
    """Reshards leaves to what the ``shard_map`` in_specs expect, if Explicit.

    Over Explicit mesh axes ``shard_map`` does not reshard its inputs: batch
    leaves must be sharded over exactly ``data_axes`` on axis 0, and other
    leaves not over them (parameters sharded over a data axis are gathered).
    Other mesh axes are kept.
    """
    if all(
        mesh.axis_types[mesh.axis_names.index(a)] != AxisType.Explicit
        for a in data_axes
    ):
        return tree

    def without_data_axes(entry: Any) -> Any:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        kept = tuple(name for name in names if name not in data_axes)
        return kept[0] if len(kept) == 1 else kept or None

    def fit(leaf: Any) -> Any:
        spec = tuple(jax.typeof(leaf).sharding.spec)
        spec += (None,) * (jnp.ndim(leaf) - len(spec))
        wanted = [without_data_axes(entry) for entry in spec]
        if split_rows:
            wanted[0] = data_axes[0] if len(data_axes) == 1 else data_axes
        if tuple(wanted) == spec:
            return leaf
        return jax.sharding.reshard(leaf, NamedSharding(mesh, PartitionSpec(*wanted)))

    return jax.tree.map(fit, tree)


def _local_split(
    batch_size: int, num_devices: int, options: AccumOptions
) -> int | None:
    """Checks the per-device split; returns the per-device micro-batch size
    (None when the split is given as ``num_microbatches``)."""
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
                "multiple of the device count, or pad=True (with "
                "reduction='weighted' or 'sum')."
            )
        return microbatch_size // num_devices
    assert num_microbatches is not None  # AccumOptions sets exactly one
    if local_size % num_microbatches and not pad:
        raise ValueError(
            f"Batch size {batch_size} over {where} is {local_size} rows per "
            f"device, which num_microbatches={num_microbatches} does not divide: "
            "each device splits its own rows into the micro-batches. Use "
            f"num_microbatches from {_split.divisors(local_size)}, a batch size "
            f"that is a multiple of {num_devices * num_microbatches}, or "
            "pad=True (with reduction='weighted' or 'sum')."
        )
    return None
