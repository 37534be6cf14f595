"""The mesh and the stacked stages: where parameters and batch lie, FSDP
dimensions, one micro-batch's shapes, and the checks of a call's arguments."""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxaccum._pipeline._calls import Calls, make_calls
from jaxaccum._pipeline._device import Shapes
from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._precision import _metadata
from jaxaccum._types import Batch, Params, PyTree, StageOrder
from jaxaccum._window import _batch_nodes, _split
from jaxaccum._window._fsdp import shard_plan
from jaxaccum._window._mesh import check_mesh_type


def explicit(mesh: Any) -> bool:
    return any(kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)


def place(tree: PyTree, mesh: Any, spec: PartitionSpec) -> PyTree:
    """``tree`` sharded as ``spec`` says (over Explicit axes ``shard_map``
    does not reshard its inputs; over Auto ones it does)."""
    if not explicit(mesh):
        return tree
    return jax.tree.map(
        lambda x: jax.sharding.reshard(x, NamedSharding(mesh, spec)), tree
    )


def reshape(x: jax.Array, shape: tuple, mesh: Any, spec: PartitionSpec) -> jax.Array:
    """``x`` reshaped, and on an Explicit mesh sharded as ``spec``."""
    if not explicit(mesh):
        return jnp.reshape(x, shape)
    sharding = NamedSharding(mesh, spec)
    return jax.sharding.reshard(jnp.reshape(x, shape, out_sharding=sharding), sharding)


def resolve_mesh(mesh: Mesh | AbstractMesh | None, options: PipelineWindow) -> Any:
    """``mesh`` (else the one set with ``jax.set_mesh``), checked to have the
    stage axis and the data axis."""
    check_mesh_type(mesh, "jax.make_mesh((4, 2), ('stage', 'data'))")
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            "No mesh: pass mesh=, or call inside `with jax.set_mesh(mesh):`; for "
            "example jax.make_mesh((4, 2), "
            f"{options.layout.manual_axes + ('data',)[:1]!r})."
        )
    for name in ("stage_axis", "data_axis"):
        axis = getattr(options.layout, name)
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh, whose axes are "
                f"{mesh.axis_names} with sizes {dict(mesh.shape)}. Give the mesh "
                f"an axis named {axis!r} (e.g. jax.make_mesh((4, 2), ('stage', "
                f"'data'))), or pass {name}= the name of the axis to use."
            )
    return mesh


def _check_stage_params(stages: Params, schedule: Schedule) -> None:
    """Every stage leaf stacks one slice per model stage: ``S * R`` of them."""
    needed = schedule.num_stages * schedule.repeats
    for path, leaf in jax.tree_util.tree_leaves_with_path(stages):
        shape = jnp.shape(leaf)
        if shape[:1] != (needed,):
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path)} has shape {shape}; "
                f"every stage parameter needs a leading axis of num_stages * "
                f"repeats = {schedule.num_stages} * {schedule.repeats} = "
                f"{needed}, stage i's slice at index i (stack the stages' "
                "parameters: jax.tree.map(lambda *p: jnp.stack(p), *stages))."
            )


def with_microbatch_count(options: PipelineWindow, batch: Batch, mesh: Any) -> PyTree:
    """``options`` with this batch's ``M`` (given, or read off the batch from
    ``microbatch_size``, rows per micro-batch on each data shard), checked to
    split the batch into pieces of equal rows on every data shard."""
    size = _split.batch_size_of([("batch", batch)])
    shards = mesh.shape[options.layout.data_axis] if options.layout.data_axis else 1
    by = " * data shards" if shards > 1 else ""
    if options.num_microbatches is not None:
        piece = options.num_microbatches * shards
        split = f"{options.num_microbatches} micro-batches"
        fix = f"num_microbatches{by} = {piece} rows, or a num_microbatches"
    else:
        assert options.microbatch_size is not None  # exactly one (PipelineWindow)
        piece = options.microbatch_size * shards
        split = f"micro-batches of {options.microbatch_size} rows"
        fix = f"microbatch_size{by} = {piece} rows, or a microbatch_size"
    if size % piece:
        over = f" on each of {shards} data shards" if shards > 1 else ""
        raise ValueError(
            f"The batch has {size} rows, which {split}{over} cannot split "
            f"equally: pass a multiple of {fix} that divides {size // shards}."
        )
    if options.num_microbatches is not None:
        return options
    return dataclasses.replace(
        options, num_microbatches=size // piece, microbatch_size=None
    )


def _microbatch_rows(batch: Batch, options: PipelineWindow, mesh: Any, num: int) -> int:
    """Rows of one micro-batch on one data shard (:func:`with_microbatch_count`
    checked that they split)."""
    size = _split.batch_size_of([("batch", batch)])
    shards = mesh.shape[options.layout.data_axis] if options.layout.data_axis else 1
    return size // (num * shards)


def _describe(tree: PyTree) -> str:
    shapes = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", tree)
    return str(shapes)


def _shapes(
    calls: Calls, like: tuple, batch: Batch, key: Any, rows: int, repeats: int
) -> Shapes:
    """One micro-batch's activation and loss shapes; a stage that changes
    the activation, or a loss that is not a scalar, is refused."""
    leaves, _ = jax.tree.flatten(batch)
    micro = jax.tree.unflatten(
        _batch_nodes.resized_treedef(batch, rows),
        [jax.ShapeDtypeStruct((rows, *jnp.shape(x)[1:]), x.dtype) for x in leaves],
    )
    embed, stage, head = like
    x = jax.eval_shape(calls.embed, embed, micro, key)
    stages = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((repeats, *s.shape), s.dtype), stage
    )
    y = jax.eval_shape(calls.stage, stages, stages, 0, True, None, x, key)
    x_tree: PyTree = jax.tree.structure(x)  # jaxlib's stubs leave PyTreeDef unresolved
    same = x_tree == jax.tree.structure(y) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
    )
    if not same:
        raise ValueError(
            f"stage_fn changes the activation: it maps x = {_describe(x)} to "
            f"{_describe(y)}. Every stage must return x's structure, shapes "
            "and dtypes (one activation flows from stage to stage); move a "
            "change of shape into embed_fn or loss_fn."
        )
    own = jax.eval_shape(calls.own_loss, head, x, micro, key)
    # loss_fn's value is checked (a real float scalar) where it is read:
    # _calls._as_loss_out, with every front end's message.
    return Shapes(x, jax.eval_shape(calls.loss, head, x, micro, key), own)


def _abstract(tree: PyTree, one_stage: bool = False) -> PyTree:
    """Shapes and dtypes of ``tree``'s leaves (of one stage's slice)."""
    return jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
            jnp.shape(p)[1 if one_stage else 0 :], jnp.result_type(p)
        ),
        tree,
    )


def _fsdp_dims(params: tuple, options: PipelineWindow) -> tuple:
    """Like ``params``, per leaf the dimension it is sharded over the data
    axis on (FSDP: gathered once per window, reduce-scattered once), or -1:
    the core's plan (``_fsdp.shard_plan``, as ``shard_value_and_grad``
    makes it) of the leaves' Explicit shardings, whose refusals hold here
    too. A stage leaf's axis 0 stacks the stages: never the data axis's."""
    data_axis = options.layout.data_axis
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tuple(params))
    if data_axis is None:
        return jax.tree.unflatten(treedef, [-1] * len(leaves))
    specs = []
    for path, leaf in leaves:
        sharding = _split.explicit_sharding(jax.typeof(leaf))
        spec = PartitionSpec() if sharding is None else sharding.spec
        if path[0].idx == 1 and spec and data_axis in _split.spec_names(spec[0]):
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path[1:])} is sharded "
                f"{spec}: its axis 0 stacks the stages, which are placed over "
                f"the stage axis, not the data axis {data_axis!r}. Shard a "
                "stage parameter over the data axis (FSDP) on another "
                "dimension, e.g. P('stage', 'data')."
            )
        specs.append(spec)
    plan = shard_plan(
        options.resharded(data_axes=(data_axis,), param_specs=tuple(specs)),
        metadata=tuple(_metadata.is_metadata(path, leaf) for path, leaf in leaves),
    )
    assert plan is not None  # it has a data axis
    return jax.tree.unflatten(treedef, [-1 if d is None else d for d in plan.dims])


class Prepared(NamedTuple):
    """What one call of the step works with, after its arguments are checked.

    Attributes:
      mesh: the device mesh.
      schedule: the window's :class:`Schedule`.
      calls: the user's functions as the loop calls them.
      shapes: one micro-batch's activation and (accumulated) loss shapes.
      rows: rows of one micro-batch on one data shard.
      shards: data shards (1 without a data axis).
      stage_axis: the mesh axis of the stages.
      like: ``(embed, one stage's, head)`` parameters' shapes and dtypes.
      fsdp_dims: like ``params``, per leaf the dimension its parameter is
        sharded over the data axis on (FSDP: gathered once per window), or
        -1; a stage leaf's counts its stacking axis.
      stage_order: ``"model"`` or ``"device"``, the stacked stages' order.
    """

    mesh: Any
    schedule: Schedule
    calls: Calls
    shapes: Shapes
    rows: int
    shards: int
    stage_axis: str
    like: tuple
    fsdp_dims: tuple
    stage_order: StageOrder = "model"


def prepare(
    functions: tuple,
    options: PipelineWindow,
    mesh: Any,
    args: tuple,
    schedule: Schedule,
):
    """Checks the call's arguments for ``schedule``; returns a
    :class:`Prepared`."""
    stage_fn, loss_fn, embed_fn = functions
    (embed, stages, head), batch, key = args
    device_mesh = resolve_mesh(mesh, options)
    _check_stage_params(stages, schedule)
    rows = _microbatch_rows(batch, options, device_mesh, schedule.num_microbatches)
    like = (_abstract(embed), _abstract(stages, one_stage=True), _abstract(head))
    calls = make_calls(stage_fn, loss_fn, embed_fn, options, like)
    shapes = _shapes(calls, like, batch, key, rows, options.layout.repeats)
    shards = (
        device_mesh.shape[options.layout.data_axis] if options.layout.data_axis else 1
    )
    return Prepared(
        device_mesh,
        schedule,
        calls,
        shapes,
        rows,
        shards,
        options.layout.stage_axis,
        like,
        _fsdp_dims((embed, stages, head), options),
        options.layout.stage_order,
    )


def layout_specs(prepared: Prepared, options: PipelineWindow) -> tuple:
    """The ``shard_map`` in_specs of ``(embed, stages, head)``: stages
    ``(R, S, ...)`` over the stage axis on axis 1, and every leaf sharded
    over the data axis (FSDP) on the dimension its parameter is."""

    def spec(lead: tuple, ndim: int, dim: int) -> PartitionSpec:
        entries = [*lead, *([None] * (ndim - len(lead)))]
        if dim >= 0:
            entries[dim + len(lead) - (1 if lead else 0)] = options.layout.data_axis
        return PartitionSpec(*entries)

    embed_dims, stage_dims, head_dims = prepared.fsdp_dims
    embed, stages, head = prepared.like
    lead = (None, options.layout.stage_axis)
    return (
        jax.tree.map(lambda p, d: spec((), p.ndim, d), embed, embed_dims),
        jax.tree.map(lambda p, d: spec(lead, p.ndim + 2, d), stages, stage_dims),
        jax.tree.map(lambda p, d: spec((), p.ndim, d), head, head_dims),
    )


def unpack_params(params: Params) -> tuple:
    """``params`` as ``(embed, stages, head)``, checked: a sequence of 3."""
    if not (isinstance(params, tuple | list) and len(params) == 3):
        got = type(params).__name__
        if isinstance(params, tuple | list):
            got += f" of length {len(params)}"
        raise TypeError(
            "The pipelined step takes params = (embed_params, stage_params, "
            f"head_params), a sequence of 3 pytrees; got a {got}. Pass None "
            "(or ()) for a part with no parameters."
        )
    return tuple(params)


def like_container(grads: tuple, params: Params) -> PyTree:
    """``grads`` in ``params``' own sequence type (a list, a NamedTuple):
    the gradients have the parameters' structure, for ``optax``."""
    if type(params) is tuple:
        return grads
    if isinstance(params, tuple):  # a NamedTuple
        return type(params)(*grads)
    return type(params)(grads)


def refuse_fp8_metadata(params: tuple) -> None:
    """FP8 metadata is refused: autodiff through the loop sums every leaf's
    cotangents over the ticks, where the window maxes the metadata."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if _metadata.is_metadata(path, leaf):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is FP8 metadata (Flax's "
                f"{_metadata.OVERWRITE_WITH_GRADIENT} collection): the pipeline "
                "would sum its new values over the ticks like a gradient, where "
                "the window's amax history is the max over its micro-batches. "
                "Pipeline FP8-free stages, or accumulate FP8 models with "
                "jaxaccum.value_and_grad or shard_value_and_grad."
            )


def like_params(grads: tuple, params: tuple, prepared: Prepared) -> tuple:
    """Gradients in the parameters' dtypes, shapes (the stages back from
    their ``(R, S, ...)`` layout to the parameters' stage order) and, on an
    Explicit mesh, shardings: a parameter's own, else the pipeline's (stages
    over the stage axis)."""
    mesh = prepared.mesh
    stage_spec = PartitionSpec(prepared.stage_axis)

    def like(grad: jax.Array, param: Any, spec: PartitionSpec) -> jax.Array:
        grad = grad.astype(jnp.result_type(param))
        if not explicit(mesh):  # the parameters' shardings are not visible
            grad = jnp.reshape(grad, jnp.shape(param))
            return lax.with_sharding_constraint(grad, NamedSharding(mesh, spec))
        own = _split.explicit_sharding(jax.typeof(param))
        sharding = own or NamedSharding(mesh, spec)
        if grad.shape != jnp.shape(param):
            grad = jnp.reshape(grad, jnp.shape(param), out_sharding=sharding)
        return jax.sharding.reshard(grad, sharding)

    embed, stages, head = grads
    if prepared.stage_order == "device":  # (R, S, ...) to (S, R, ...): local
        stages = jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1), stages)
    return (
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), embed, params[0]),
        jax.tree.map(lambda g, p: like(g, p, stage_spec), stages, params[1]),
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), head, params[2]),
    )
