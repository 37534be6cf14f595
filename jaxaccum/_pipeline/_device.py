"""What one device's window reads under ``shard_map``, on either schedule:
its parameters (FSDP leaves gathered), its strided micro-batches and their
keys, the bubbles' fill, and the selects and casts both loops use."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._pipeline._calls import Calls, LossOut
from jaxaccum._pipeline._schedule import Schedule
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._types import Batch, Params, PyTree
from jaxaccum._window import _split


def select(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """``jnp.where`` leaf by leaf: a select, so a NaN in the branch not taken
    reaches neither the value nor, in the backward pass, the cotangent."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def varying(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """``tree`` typed as varying over every axis of ``axes``. Parameters
    cast before the loop have their gradients all-reduced once, after it, by
    the transpose of this cast (were it left to JAX, inside the loop, the
    reduction could land there: once per tick)."""

    def cast(x: PyTree) -> PyTree:
        already = jax.typeof(x).manual_axis_type.varying
        missing = tuple(a for a in axes if a not in already)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


class Shapes(NamedTuple):
    """The shapes of one micro-batch's activation ``x`` and loss (as the
    window sums it, and in ``loss_fn``'s own dtypes)."""

    x: PyTree
    loss: LossOut
    own: LossOut


class Probes(NamedTuple):
    """Zeros whose gradients are squared norms of parameter gradients: per
    micro-batch of its embedding's and its head's, per tick of the stage's.
    Each ``(S, D, M)``, ``(S, D, T)``, ``(S, D, M)`` over the devices."""

    embed: jax.Array
    stage: jax.Array
    head: jax.Array


class Device(NamedTuple):
    """What one device's window reads, fixed over the window."""

    calls: Calls
    options: PipelineWindow
    schedule: Schedule
    stage: jax.Array
    embed: Any
    stages: Params
    own_stages: Any
    head: Any
    batch: _split.StridedBatch
    keys: PyTree
    fill: Any
    no_loss: LossOut


def fill_like(shapes: PyTree, value: float) -> PyTree:
    """Arrays of ``shapes`` holding ``value`` (0 in non-float leaves)."""

    def full(s: Any) -> jax.Array:
        inexact = jnp.issubdtype(s.dtype, jnp.inexact)
        return jnp.full(s.shape, value if inexact else 0, s.dtype)

    return jax.tree.map(full, shapes)


def microbatch_keys(key: Any, options: PipelineWindow, num: int) -> PyTree:
    """Micro-batch ``k``'s key is ``split(key, M)[k]``, after folding in the
    data shard's index: the same for every tick and stage that carries it."""
    if key is None:
        return None
    if options.layout.data_axis:
        key = jax.random.fold_in(key, lax.axis_index(options.layout.data_axis))
    return jax.random.split(key, num)


def microbatch_key(device: Device, index: Any, layer: Any) -> PyTree:
    """The key of micro-batch ``index`` at model stage ``layer`` (``S R``
    for the embedding, ``S R + 1`` for the loss), None without a key."""
    if device.keys is None:
        return None
    return jax.random.fold_in(device.keys[index], layer)


class Static(NamedTuple):
    """What every device's window is built from, fixed when the step is
    traced, on either schedule.

    Attributes:
      calls: the user's functions as the loop calls them.
      options: the step's options.
      schedule: the window's ticks.
      shapes: one micro-batch's activation and loss shapes.
      fsdp_dims: per parameter leaf, its FSDP dimension or -1.
      bubble_fill: what bubbles compute on (tests poison it with NaN).
    """

    calls: Calls
    options: PipelineWindow
    schedule: Schedule
    shapes: Shapes
    fsdp_dims: tuple
    bubble_fill: float


def make_device(static: Static, params: tuple, batch: Batch, key: Any) -> Device:
    """This device's :class:`Device` under ``shard_map``, either schedule:
    its ``(embed, stages, head)`` (its stages' ``(R, ...)``; FSDP leaves
    gathered once, before the loop, their gradients reduce-scattered once,
    after it), its strided micro-batches and their keys, the fills."""
    calls, options, schedule, shapes, fsdp_dims, bubble_fill = static
    axes = options.layout.manual_axes
    embed, stages, head = params
    stages = jax.tree.map(lambda p: p[:, 0], stages)  # (R, ...): this device's
    embed, stages, head = varying(
        jax.tree.map(
            lambda p, dim: (
                p
                if dim < 0
                else lax.all_gather(p, options.layout.data_axis, axis=dim, tiled=True)
            ),
            (embed, stages, head),
            fsdp_dims,
        ),
        axes,
    )
    return Device(
        calls=calls,
        options=options,
        schedule=schedule,
        stage=lax.axis_index(options.layout.stage_axis),
        embed=embed,
        stages=stages,
        own_stages=calls.own_stages(stages),
        head=head,
        batch=_split.strided_batch(batch, schedule.num_microbatches),
        keys=microbatch_keys(key, options, schedule.num_microbatches),
        fill=varying(fill_like(shapes.x, bubble_fill), axes),
        no_loss=varying(fill_like(shapes.loss, 0.0), axes),
    )
