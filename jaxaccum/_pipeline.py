"""Pipeline parallelism: the window's micro-batches are the pipeline's.

GPipe is gradient accumulation whose micro-batches flow through model stages
placed on different devices. :func:`pipeline_value_and_grad` runs one window
as one ``lax.scan`` of ``M R + S - 1`` ticks under ``jax.shard_map``, manual
over the stage axis (and the data axis, if any). At tick ``t`` the device of
stage ``d`` runs iteration ``i = t - d``: micro-batch ``i mod M`` through its
stage of repeat ``i // M``, on the activation its neighbour handed it at tick
``t - 1`` (``lax.ppermute``). The first stage's device embeds every
micro-batch before the loop, the last stage's takes every loss after it (one
``lax.cond`` each); the backward pass is autodiff through the scan (the
transpose of a ``ppermute`` is the reverse ``ppermute``). The window is the
pipeline, so fill and drain are paid once per optimizer step, not once per
accumulation step as when a pipeline is nested inside accumulation.

Bubbles (ticks ``i < 0`` or ``i >= M R``) compute on a fill value and are
masked with ``jnp.where`` (a select, never a product): their stage input is
the fill, their cotangents are selected away (:func:`_gated_stage`), and
nothing they compute reaches the loss, so a NaN made in a bubble cannot reach
a gradient.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxaccum import _metadata, _split
from jaxaccum._noise_scale import MicroStats, WindowStats, squared_norm, window_stats
from jaxaccum._options import REDUCTIONS, check_count, check_positive_int
from jaxaccum._reduce import divide_by_total_weight
from jaxaccum._window import accum_dtype_for

PIPELINE_AUX_REDUCTIONS = ("mean", "sum")


class Schedule(NamedTuple):
    """The ticks of one window: ``M`` micro-batches through ``S`` stage
    devices, each holding ``R`` stages (circular when ``R > 1``).

    Attributes:
      num_stages: ``S``, the size of the stage axis.
      num_microbatches: ``M``.
      repeats: ``R``; model stage ``r S + d`` runs on device ``d``.
    """

    num_stages: int
    num_microbatches: int
    repeats: int

    @property
    def num_ticks(self) -> int:
        """``M R + S - 1``: each device runs ``M R`` iterations, the last
        device starting ``S - 1`` ticks after the first."""
        return self.num_microbatches * self.repeats + self.num_stages - 1

    @property
    def bubble_fraction(self) -> float:
        """``(S - 1) / (M R + S - 1)``: the share of a device's ticks idle."""
        return (self.num_stages - 1) / self.num_ticks

    @property
    def recirculation_delay(self) -> int:
        """Ticks an activation leaving the last stage waits before the first
        stage runs its next repeat: ``M - S`` (a buffer of that many)."""
        return self.num_microbatches - self.num_stages if self.repeats > 1 else 0

    def at(self, tick: jax.Array, stage: jax.Array) -> "Tick":
        """What the device of ``stage`` does at ``tick``."""
        total = self.num_microbatches * self.repeats
        iteration = tick - stage
        valid = (iteration >= 0) & (iteration < total)
        safe = jnp.clip(iteration, 0, total - 1)
        repeat = safe // self.num_microbatches
        return Tick(
            valid=valid,
            microbatch=safe % self.num_microbatches,
            repeat=repeat,
            layer=repeat * self.num_stages + stage,
            enters=valid & (stage == 0) & (repeat == 0),
            exits=valid & (stage == self.num_stages - 1) & (repeat == self.repeats - 1),
        )


class Tick(NamedTuple):
    """One device's work at one tick (traced scalars).

    Attributes:
      valid: False in a bubble.
      microbatch: the micro-batch it carries (clipped in a bubble).
      repeat: the repeat of its stage (clipped in a bubble).
      layer: the model stage it applies, ``repeat * S + stage``.
      enters: the first stage's first repeat: the micro-batch enters.
      exits: the last stage's last repeat: the micro-batch leaves, its
        activation is the one its loss is taken on.
    """

    valid: jax.Array
    microbatch: jax.Array
    repeat: jax.Array
    layer: jax.Array
    enters: jax.Array
    exits: jax.Array


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How a window is pipelined; see :func:`pipeline_value_and_grad`.

    Attributes:
      num_microbatches: ``M``.
      stage_axis: the mesh axis stages are placed on.
      data_axis: the mesh axis the batch is sharded over, or None.
      repeats: ``R``, stages per device (circular schedule when > 1).
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      aux_reduction: ``"mean"`` or ``"sum"``.
      accum_dtype: dtype float gradients accumulate in (at least), or None.
      remat: ``True`` or a checkpoint policy: ``jax.checkpoint`` every call.
      report_stats: also return :class:`jaxaccum.WindowStats`.
      unroll: passed to ``jax.lax.scan``.
      bubble_fill: what bubbles compute on (tests poison it with NaN).
    """

    num_microbatches: int
    stage_axis: str = "stage"
    data_axis: str | None = None
    repeats: int = 1
    reduction: str = "mean"
    has_aux: bool = False
    aux_reduction: str = "mean"
    accum_dtype: Any = jnp.float32
    remat: Any = False
    report_stats: bool = False
    unroll: int | bool = 1
    bubble_fill: float = 0.0

    def __post_init__(self) -> None:
        check_count("num_microbatches", self.num_microbatches)
        check_positive_int("repeats", self.repeats)
        for name in ("stage_axis", "data_axis"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (name == "data_axis" and value is None)):
                raise TypeError(f"{name} must be a mesh axis name, got {value!r}.")
        if self.data_axis == self.stage_axis:
            raise ValueError(
                f"data_axis and stage_axis are both {self.stage_axis!r}: the "
                "batch is sharded over one mesh axis, the stages placed on "
                "another."
            )
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}."
            )
        if self.aux_reduction not in PIPELINE_AUX_REDUCTIONS:
            raise ValueError(
                f"aux_reduction must be one of {PIPELINE_AUX_REDUCTIONS} in a "
                f"pipeline, got {self.aux_reduction!r}: each micro-batch's aux "
                "is computed on the last stage's device, per data shard."
            )

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the window runs manual over."""
        return (self.stage_axis,) + ((self.data_axis,) if self.data_axis else ())

    def schedule(self, mesh: Any) -> Schedule:
        """The schedule on ``mesh``; ``M < S`` with ``R > 1`` is refused."""
        schedule = Schedule(
            mesh.shape[self.stage_axis], self.num_microbatches, self.repeats
        )
        if self.repeats > 1 and self.num_microbatches < schedule.num_stages:
            raise ValueError(
                f"repeats={self.repeats} needs num_microbatches >= the "
                f"{schedule.num_stages} stages, got {self.num_microbatches}: a "
                "micro-batch leaving the last stage re-enters the first stage "
                "M ticks after it first entered, which must not be before the "
                f"first stage has passed it on. Use M >= {schedule.num_stages}, "
                "or repeats=1 (any M; the bubble is then "
                f"{schedule.num_stages - 1} of every "
                f"{self.num_microbatches + schedule.num_stages - 1} ticks)."
            )
        return schedule


class LossOut(NamedTuple):
    """One micro-batch's loss as the window sums it (float32 by default).

    Attributes:
      loss: its mean loss (``"mean"``), loss sum (``"sum"``, ``"weighted"``).
      weight: its weight with ``"weighted"``, else ``()``.
      aux: its aux output with ``has_aux``, else ``()``.
    """

    loss: jax.Array
    weight: Any
    aux: Any


class Calls(NamedTuple):
    """The user's functions as the window calls them, parameters arriving in
    the accumulation dtype (cast back to their own here) and keys passed as
    ``key=`` where the step has one.

    Attributes:
      embed: ``embed(params, micro_batch, key) -> x`` (rematerialised with
        ``remat``).
      stage: ``stage(stages, own, repeat, valid, probe, x, key) -> x``: the
        device's stage of ``repeat`` (its slice of ``own``, the ``stages``
        in their own dtype) on ``x``, its gradient selected away unless
        ``valid`` and accumulated in ``stages``' dtype (see
        :func:`_gated_stage`). Never saves the slice for the backward pass
        (a copy of a stage's parameters per tick); with ``remat``, saves what
        its policy says (nothing: ``True``).
      loss: ``loss(params, x, micro_batch, key) -> LossOut`` (rematerialised
        with ``remat``).
      own_stages: ``own_stages(stages)``, the stacked stage parameters cast
        to their own dtype (no gradient: ``stage`` routes it to ``stages``).
    """

    embed: Callable[..., Any]
    stage: Callable[..., Any]
    loss: Callable[..., LossOut]
    own_stages: Callable[[Any], Any]


def takes_key(fn: Callable[..., Any] | None) -> bool:
    """Whether ``fn`` takes a keyword argument ``key`` (or ``**kwargs``)."""
    if fn is None:
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C function)
        return False
    return any(
        p.name == "key"
        and p.kind is not inspect.Parameter.POSITIONAL_ONLY
        or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in parameters
    )


def _keyword(fn: Callable[..., Any] | None, key: Any) -> dict:
    """``{"key": key}`` for a function that takes it and a key, else ``{}``."""
    return {"key": key} if key is not None and takes_key(fn) else {}


def _as_loss_out(out: Any, options: PipelineOptions) -> LossOut:
    """``loss_fn``'s result as a :class:`LossOut` in the accumulation dtype."""
    loss, aux = out if options.has_aux else (out, ())
    weight: Any = ()
    if options.reduction == "weighted":
        if not (isinstance(loss, tuple | list) and len(loss) == 2):
            raise TypeError(
                "With reduction='weighted', loss_fn must return (loss_sum, "
                "weight) (with has_aux: ((loss_sum, weight), aux)): the sum of "
                "its micro-batch's per-token losses and their count (or total "
                f"weight); got {type(loss).__name__}."
            )
        loss, weight = loss
        weight = jnp.asarray(weight).astype(options.accum_dtype or jnp.float32)
    loss = jnp.asarray(loss)
    dtype = accum_dtype_for(loss.dtype, options.accum_dtype)
    aux = jax.tree.map(
        lambda leaf: jnp.asarray(leaf).astype(
            accum_dtype_for(jnp.result_type(leaf, jnp.float32), options.accum_dtype)
        ),
        aux,
    )
    return LossOut(loss.astype(dtype), weight, aux)


# Operations that only move or retype data: their results are recomputed in
# the backward pass, never saved. The tick's slice of the device's stages
# comes out of a chain of them, and saving it would keep a copy of a stage's
# parameters per tick; in an activation's chain, their input is saved instead.
_RECOMPUTED = (
    lax.dynamic_slice_p,
    lax.slice_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.broadcast_in_dim_p,
    lax.transpose_p,
    lax.convert_element_type_p,
    lax.copy_p,
)


def _stage_policy(remat: Any) -> Callable[..., bool]:
    """The stage's checkpoint policy: everything saveable except the data
    movement of :data:`_RECOMPUTED` (so the tick's parameters are sliced
    again in the backward pass, not saved per tick); with ``remat``, only
    what its policy saves (nothing, for ``True``)."""

    def saveable(prim: Any, *_: Any, **__: Any) -> bool:
        return prim not in _RECOMPUTED

    if not remat:
        return saveable
    user = jax.checkpoint_policies.nothing_saveable if remat is True else remat

    def policy(prim: Any, *args: Any, **kwargs: Any) -> bool:
        return saveable(prim) and user(prim, *args, **kwargs)

    return policy


def _gated_stage(stage: Callable[..., Any], accum_dtype: Any) -> Callable[..., Any]:
    """``stage(own, repeat, x, key)`` as ``gated(accum, own, repeat, valid,
    probe, x, key)``, whose backward pass selects its cotangents away unless
    ``valid`` (a bubble's gradient is 0, even where what it computed on gives
    NaN or inf derivatives: ``0 * inf`` is not 0) and casts the parameters'
    up to ``accum``'s dtype (the gradient accumulates there across ticks).
    ``own`` is ``accum`` in the parameters' own dtype, cast once before the
    loop: no forward operation touches the parameters per tick. With a
    ``probe``, its cotangent is the squared norm of the (gated) gradient."""

    @jax.custom_vjp
    def gated(accum, own, repeat, valid, probe, x, key):
        del accum, valid, probe
        return stage(own, repeat, x, key)

    def forward(accum, own, repeat, valid, probe, x, key):
        del accum
        y, pullback = jax.vjp(lambda p, x: stage(p, repeat, x, key), own, x)
        return y, (pullback, valid, probe)

    def backward(residuals, cotangent):
        pullback, valid, probe = residuals
        own_grad, x_grad = pullback(cotangent)
        grad = jax.tree.map(
            lambda g: jnp.where(
                valid, g.astype(accum_dtype_for(g.dtype, accum_dtype)), 0
            ),
            own_grad,
        )
        probe_grad = (
            None if probe is None else jnp.zeros_like(probe) + squared_norm(grad)
        )
        x_grad = jax.tree.map(lambda g: jnp.where(valid, g, 0), x_grad)
        return grad, None, None, None, probe_grad, x_grad, None

    gated.defvjp(forward, backward)
    return gated


def make_calls(
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    embed_fn: Callable[..., Any] | None,
    options: PipelineOptions,
    like: tuple,
) -> Calls:
    """The window's :class:`Calls`; ``like`` holds ``(embed, one stage's,
    head)`` parameters in their own dtypes (what each call casts back to)."""
    embed_like, stage_like, head_like = like

    def embed(params, micro_batch, key):
        if embed_fn is None:
            return micro_batch
        params = optax.tree.cast_like(params, embed_like)
        return embed_fn(params, micro_batch, **_keyword(embed_fn, key))

    def stage(own, repeat, x, key):
        params = jax.tree.map(
            lambda p: lax.dynamic_index_in_dim(p, repeat, 0, keepdims=False), own
        )
        return stage_fn(params, x, **_keyword(stage_fn, key))

    def own_stages(stages):
        stacked = jax.tree.map(lambda p, s: p.astype(s.dtype), stages, stage_like)
        return lax.stop_gradient(stacked)

    def loss(params, x, micro_batch, key):
        params = optax.tree.cast_like(params, head_like)
        out = loss_fn(params, x, micro_batch, **_keyword(loss_fn, key))
        return _as_loss_out(out, options)

    stage_policy = _stage_policy(options.remat)
    stage = _gated_stage(
        jax.checkpoint(stage, policy=stage_policy), options.accum_dtype
    )
    if options.remat:
        policy = None if isinstance(options.remat, bool) else options.remat
        embed = jax.checkpoint(embed, policy=policy)
        loss = jax.checkpoint(loss, policy=policy)
    return Calls(embed, stage, loss, own_stages)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where`` leaf by leaf: a select, so a NaN in the branch not taken
    reaches neither the value nor, in the backward pass, the cotangent."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _varying(tree: Any, axes: tuple[str, ...]) -> Any:
    """``tree`` typed as varying over every axis of ``axes``. Parameters
    cast before the loop have their gradients all-reduced once, after it, by
    the transpose of this cast (were it left to JAX, inside the loop, the
    reduction could land there: once per tick)."""

    def cast(x: Any) -> Any:
        varying = jax.typeof(x).manual_axis_type.varying
        missing = tuple(a for a in axes if a not in varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


@jax.custom_vjp
def _probe(tree: Any, probe: jax.Array) -> Any:
    """``tree`` unchanged; in the backward pass the cotangent of ``probe``
    is the float32 squared norm of ``tree``'s (``report_stats``)."""
    del probe
    return tree


def _probe_fwd(tree: Any, probe: jax.Array) -> tuple[Any, jax.Array]:
    return tree, probe


def _probe_bwd(probe: jax.Array, cotangent: Any) -> tuple[Any, jax.Array]:
    return cotangent, jnp.zeros_like(probe) + squared_norm(cotangent)


_probe.defvjp(_probe_fwd, _probe_bwd)


class Probes(NamedTuple):
    """Zeros whose gradients are squared norms of parameter gradients: per
    micro-batch of its embedding's and its head's, per tick of the stage's.
    Each ``(S, D, M)``, ``(S, D, T)``, ``(S, D, M)`` over the devices."""

    embed: jax.Array
    stage: jax.Array
    head: jax.Array


class Shapes(NamedTuple):
    """The shapes of one micro-batch's activation ``x`` and loss."""

    x: Any
    loss: LossOut


class _Device(NamedTuple):
    """What one device's window reads, fixed over the window."""

    calls: Calls
    options: PipelineOptions
    schedule: Schedule
    stage: jax.Array
    embed: Any
    stages: Any
    own_stages: Any
    head: Any
    batch: _split.StridedBatch
    keys: Any
    fill: Any
    no_loss: LossOut


class _Carry(NamedTuple):
    """The scan carry of a device.

    Attributes:
      incoming: the activation the previous stage's device handed over.
      waiting: with ``R > 1`` and ``M > S``, activations that left the last
        stage, waiting for the first stage's next repeat (a ring buffer of
        ``M - S``), else ``()``.
    """

    incoming: Any
    waiting: Any


def _microbatch_key(device: _Device, index: Any, layer: Any) -> Any:
    """The key of micro-batch ``index`` at model stage ``layer`` (``S R``
    for the embedding, ``S R + 1`` for the loss), None without a key."""
    if device.keys is None:
        return None
    return jax.random.fold_in(device.keys[index], layer)


def _map(fn: Callable[..., Any], xs: tuple, unroll: int | bool) -> Any:
    """``fn(*x)`` for each ``x`` of ``xs`` (split on axis 0), stacked: a scan."""
    return lax.scan(lambda _, x: (None, fn(*x)), None, xs, unroll=unroll)[1]


def _embedded(device: _Device, probes: jax.Array | None) -> Any:
    """``(M, ...)``: every micro-batch embedded, on the first stage's device
    (the fill elsewhere), before the loop: one conditional per window."""
    num, schedule = device.options.num_microbatches, device.schedule
    layers = schedule.num_stages * schedule.repeats

    def embed_one(index, probe):
        params = device.embed if probe is None else _probe(device.embed, probe)
        micro = device.batch.microbatch(index)
        return device.calls.embed(params, micro, _microbatch_key(device, index, layers))

    def embed_all():
        out = _map(embed_one, (jnp.arange(num), probes), device.options.unroll)
        return _varying(out, device.options.manual_axes)

    fills = _repeated(device.fill, num)
    return lax.cond(device.stage == 0, embed_all, lambda: fills)


def _losses(device: _Device, leaving: Any, probes: jax.Array | None) -> LossOut:
    """Each micro-batch's :class:`LossOut` (stacked), from its activation
    leaving the last stage, on the last stage's device (zeros elsewhere),
    after the loop: one conditional per window."""
    num, schedule = device.options.num_microbatches, device.schedule
    layers = schedule.num_stages * schedule.repeats

    def loss_one(index, x, probe):
        params = device.head if probe is None else _probe(device.head, probe)
        micro = device.batch.microbatch(index)
        key = _microbatch_key(device, index, layers + 1)
        return device.calls.loss(params, x, micro, key)

    def loss_all():
        xs = (jnp.arange(num), leaving, probes)
        out = _map(loss_one, xs, device.options.unroll)
        return _varying(out, device.options.manual_axes)

    zeros = _repeated(device.no_loss, num)
    return lax.cond(device.stage == schedule.num_stages - 1, loss_all, lambda: zeros)


def _recirculated(device: _Device, carry: _Carry, tick_index: jax.Array):
    """The activation that left the last stage ``M`` iterations ago (the
    first stage's input for its next repeat), and the updated buffer."""
    delay = device.schedule.recirculation_delay
    if delay == 0:
        return carry.incoming, carry.waiting
    slot = tick_index % delay
    out = jax.tree.map(
        lambda b: lax.dynamic_index_in_dim(b, slot, 0, keepdims=False), carry.waiting
    )
    waiting = jax.tree.map(
        lambda b, x: lax.dynamic_update_index_in_dim(b, x, slot, 0),
        carry.waiting,
        carry.incoming,
    )
    return out, waiting


def _tick(device: _Device, carry: _Carry, xs: tuple) -> tuple[_Carry, Any]:
    """One tick of one device: its stage on its input (the fill in a
    bubble), the result handed to the next stage's device; returns the
    result where a micro-batch leaves the last stage (the fill elsewhere)."""
    tick_index, entering, probe = xs
    schedule = device.schedule
    tick = schedule.at(tick_index, device.stage)
    first, waiting = entering, carry.waiting
    if schedule.repeats > 1:
        recirculated, waiting = _recirculated(device, carry, tick_index)
        first = _select(tick.repeat == 0, entering, recirculated)
    x = _select(device.stage == 0, first, carry.incoming)
    x = _select(tick.valid, x, device.fill)
    with jax.named_scope("jaxaccum_pipeline_stage"):
        key = _microbatch_key(device, tick.microbatch, tick.layer)
        y = device.calls.stage(
            device.stages, device.own_stages, tick.repeat, tick.valid, probe, x, key
        )
    num = schedule.num_stages
    ring = [(d, d + 1) for d in range(num - 1)]
    if schedule.repeats > 1:
        ring.append((num - 1, 0))
    incoming = lax.ppermute(y, device.options.stage_axis, ring)
    return _Carry(incoming, waiting), _select(tick.exits, y, device.fill)


def _repeated(tree: Any, count: int) -> Any:
    """``tree``'s leaves stacked ``count`` times on a new axis 0."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), tree)


def _fill_like(shapes: Any, value: float) -> Any:
    """Arrays of ``shapes`` holding ``value`` (0 in non-float leaves)."""

    def full(s: Any) -> jax.Array:
        inexact = jnp.issubdtype(s.dtype, jnp.inexact)
        return jnp.full(s.shape, value if inexact else 0, s.dtype)

    return jax.tree.map(full, shapes)


def _microbatch_keys(key: Any, options: PipelineOptions) -> Any:
    """Micro-batch ``k``'s key is ``split(key, M)[k]``, after folding in the
    data shard's index: the same for every tick and stage that carries it."""
    if key is None:
        return None
    if options.data_axis:
        key = jax.random.fold_in(key, lax.axis_index(options.data_axis))
    return jax.random.split(key, options.num_microbatches)


def _run_ticks(device: _Device, entering: Any, probes: jax.Array | None) -> Any:
    """The loop: ``T`` ticks; returns ``(M, ...)``, each micro-batch's
    activation as it left the last stage (on the last stage's device).

    Entering and leaving activations are the scan's inputs and outputs,
    indexed by tick, not buffers indexed by micro-batch in the carry (whose
    transposes would add a whole buffer per tick).
    """
    schedule, num = device.schedule, device.options.num_microbatches
    ticks = schedule.num_ticks
    pad = _repeated(device.fill, ticks - num)
    entering = jax.tree.map(lambda e, p: jnp.concatenate([e, p]), entering, pad)
    delay = schedule.recirculation_delay
    fill = device.fill
    waiting = _repeated(fill, delay) if delay else ()
    _, leaving = lax.scan(
        functools.partial(_tick, device),
        _Carry(fill, waiting),
        (jnp.arange(ticks), entering, probes),
        unroll=device.options.unroll,
    )
    first_exit = num * (schedule.repeats - 1) + schedule.num_stages - 1
    return jax.tree.map(lambda y: y[first_exit : first_exit + num], leaving)


def _on_device(
    calls: Calls,
    options: PipelineOptions,
    schedule: Schedule,
    shapes: Shapes,
    fsdp_dims: tuple,
    params: tuple,
    probes: Probes | None,
    batch: Any,
    key: Any,
) -> tuple[jax.Array, tuple[LossOut, LossOut]]:
    """One device's window under ``shard_map``.

    Returns the loss sum (differentiated), and the :class:`LossOut` summed
    over micro-batches and devices and, per micro-batch, the loss and weight
    (``(1, 1, M)`` per device, for the stats).
    """
    axes = options.manual_axes
    embed, stages, head = params
    stages = jax.tree.map(lambda p: p[:, 0], stages)  # (R, ...): this device's
    # FSDP leaves gathered once, before the loop: reduce-scattered once after.
    embed, stages, head = jax.tree.map(
        lambda p, dim: (
            p if dim < 0 else lax.all_gather(p, options.data_axis, axis=dim, tiled=True)
        ),
        (embed, stages, head),
        fsdp_dims,
    )
    embed, stages, head = _varying((embed, stages, head), axes)
    device = _Device(
        calls=calls,
        options=options,
        schedule=schedule,
        stage=lax.axis_index(options.stage_axis),
        embed=embed,
        stages=stages,
        own_stages=calls.own_stages(stages),
        head=head,
        batch=_split.strided_batch(batch, options.num_microbatches),
        keys=_microbatch_keys(key, options),
        fill=_varying(_fill_like(shapes.x, options.bubble_fill), axes),
        no_loss=_varying(_fill_like(shapes.loss, 0.0), axes),
    )
    if probes is not None:
        probes = jax.tree.map(lambda p: p.reshape(-1), probes)
    entering = _embedded(device, None if probes is None else probes.embed)
    leaving = _run_ticks(device, entering, None if probes is None else probes.stage)
    per_micro = _losses(device, leaving, None if probes is None else probes.head)
    sums = lax.psum(jax.tree.map(lambda x: jnp.sum(x, 0), per_micro), axes)
    per_micro = per_micro._replace(aux=())
    per_micro = jax.tree.map(lambda y: y.reshape(1, 1, *y.shape), per_micro)
    return sums.loss, (sums, per_micro)


def _explicit(mesh: Any) -> bool:
    return any(kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)


def _place(tree: Any, mesh: Any, spec: PartitionSpec) -> Any:
    """``tree`` sharded as ``spec`` says (over Explicit axes ``shard_map``
    does not reshard its inputs; over Auto ones it does)."""
    if not _explicit(mesh):
        return tree
    return jax.tree.map(
        lambda x: jax.sharding.reshard(x, NamedSharding(mesh, spec)), tree
    )


def _reshape(x: jax.Array, shape: tuple, mesh: Any, spec: PartitionSpec) -> jax.Array:
    """``x`` reshaped, and on an Explicit mesh sharded as ``spec``."""
    if not _explicit(mesh):
        return jnp.reshape(x, shape)
    sharding = NamedSharding(mesh, spec)
    return jax.sharding.reshard(jnp.reshape(x, shape, out_sharding=sharding), sharding)


def resolve_mesh(mesh: Mesh | AbstractMesh | None, options: PipelineOptions) -> Any:
    """``mesh`` (else the one set with ``jax.set_mesh``), checked to have the
    stage axis and the data axis."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            "No mesh: pass mesh=, or call inside `with jax.set_mesh(mesh):`; for "
            f"example jax.make_mesh((4, 2), {options.manual_axes + ('data',)[:1]!r})."
        )
    for name in ("stage_axis", "data_axis"):
        axis = getattr(options, name)
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh, whose axes are "
                f"{mesh.axis_names} with sizes {dict(mesh.shape)}. Give the mesh "
                f"an axis named {axis!r} (e.g. jax.make_mesh((4, 2), ('stage', "
                f"'data'))), or pass {name}= the name of the axis to use."
            )
    return mesh


def _check_stage_params(stages: Any, schedule: Schedule) -> None:
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


def _microbatch_rows(batch: Any, options: PipelineOptions, mesh: Any) -> int:
    """Rows of one micro-batch on one data shard; the batch must split."""
    size = _split.batch_size_of([("batch", batch)])
    shards = mesh.shape[options.data_axis] if options.data_axis else 1
    pieces = options.num_microbatches * shards
    if size % pieces:
        over = f" on each of {shards} data shards" if shards > 1 else ""
        raise ValueError(
            f"The batch has {size} rows, which {options.num_microbatches} "
            f"micro-batches{over} cannot split equally: pass a multiple of "
            f"num_microbatches{' * data shards' if shards > 1 else ''} = {pieces} "
            f"rows, or a num_microbatches that divides {size // shards}."
        )
    return size // pieces


def _describe(tree: Any) -> str:
    shapes = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", tree)
    return str(shapes)


def _shapes(
    calls: Calls, like: tuple, batch: Any, key: Any, rows: int, repeats: int
) -> Shapes:
    """One micro-batch's activation and loss shapes; a stage that changes
    the activation, or a loss that is not a scalar, is refused."""
    leaves, _ = jax.tree.flatten(batch)
    micro = jax.tree.unflatten(
        _split.resized_treedef(batch, rows),
        [jax.ShapeDtypeStruct((rows, *jnp.shape(x)[1:]), x.dtype) for x in leaves],
    )
    embed, stage, head = like
    x = jax.eval_shape(calls.embed, embed, micro, key)
    stages = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((repeats, *s.shape), s.dtype), stage
    )
    y = jax.eval_shape(calls.stage, stages, stages, 0, True, None, x, key)
    x_tree: Any = jax.tree.structure(x)  # jaxlib's stubs leave PyTreeDef unresolved
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
    loss = jax.eval_shape(calls.loss, head, x, micro, key)
    if jnp.shape(loss.loss) != ():
        raise TypeError(
            f"loss_fn must return a scalar loss for its micro-batch, got shape "
            f"{jnp.shape(loss.loss)}."
        )
    return Shapes(x, loss)


def _abstract(tree: Any, one_stage: bool = False) -> Any:
    """Shapes and dtypes of ``tree``'s leaves (of one stage's slice)."""
    return jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
            jnp.shape(p)[1 if one_stage else 0 :], jnp.result_type(p)
        ),
        tree,
    )


def _fsdp_dims(params: tuple, data_axis: str | None) -> tuple:
    """Per leaf, the dimension an Explicit mesh shards it over ``data_axis``
    on, or -1 (a stage leaf's stacking axis cannot be)."""

    def dim_of(path: Any, leaf: Any) -> int:
        sharding = _split.explicit_sharding(jax.typeof(leaf))
        if data_axis is None or sharding is None:
            return -1
        dims = [
            dim
            for dim, entry in enumerate(sharding.spec)
            if data_axis in _split.spec_names(entry)
        ]
        if dims[:1] == [0] and path[0].idx == 1:
            raise ValueError(
                f"stage_params{jax.tree_util.keystr(path[1:])} is sharded "
                f"{sharding.spec}: its axis 0 stacks the stages, which are "
                f"placed over the stage axis, not the data axis {data_axis!r}. "
                "Shard a stage parameter over the data axis (FSDP) on another "
                "dimension, e.g. P('stage', 'data')."
            )
        return dims[0] if dims else -1

    return jax.tree_util.tree_map_with_path(dim_of, tuple(params))


class _Prepared(NamedTuple):
    """What one call of the step works with, after its arguments are checked.

    Attributes:
      mesh: the device mesh.
      schedule: the window's :class:`Schedule`.
      calls: the user's functions as the loop calls them.
      shapes: one micro-batch's activation and (accumulated) loss shapes.
      own: the loss's shapes in the dtypes ``loss_fn`` returns them.
      rows: rows of one micro-batch on one data shard.
      shards: data shards (1 without a data axis).
      stage_axis: the mesh axis of the stages.
      like: ``(embed, one stage's, head)`` parameters' shapes and dtypes.
      fsdp_dims: like ``params``, per leaf the dimension its parameter is
        sharded over the data axis on (FSDP: gathered once per window), or
        -1; a stage leaf's counts its stacking axis.
    """

    mesh: Any
    schedule: Schedule
    calls: Calls
    shapes: Shapes
    own: LossOut
    rows: int
    shards: int
    stage_axis: str
    like: tuple
    fsdp_dims: tuple


def _prepare(functions: tuple, options: PipelineOptions, mesh: Any, args: tuple):
    """Checks the call's arguments; returns a :class:`_Prepared`."""
    stage_fn, loss_fn, embed_fn = functions
    (embed, stages, head), batch, key = args
    device_mesh = resolve_mesh(mesh, options)
    schedule = options.schedule(device_mesh)
    _check_stage_params(stages, schedule)
    rows = _microbatch_rows(batch, options, device_mesh)
    like = (_abstract(embed), _abstract(stages, one_stage=True), _abstract(head))
    calls = make_calls(stage_fn, loss_fn, embed_fn, options, like)
    shapes = _shapes(calls, like, batch, key, rows, options.repeats)
    own_options = dataclasses.replace(options, accum_dtype=None)
    own = _shapes(
        make_calls(stage_fn, loss_fn, embed_fn, own_options, like),
        like,
        batch,
        key,
        rows,
        options.repeats,
    ).loss
    if options.reduction == "weighted" and jnp.shape(shapes.loss.weight) != ():
        raise TypeError(
            "With reduction='weighted', the weight loss_fn returns must be a "
            f"scalar, got shape {jnp.shape(shapes.loss.weight)}."
        )
    shards = device_mesh.shape[options.data_axis] if options.data_axis else 1
    return _Prepared(
        device_mesh,
        schedule,
        calls,
        shapes,
        own,
        rows,
        shards,
        options.stage_axis,
        like,
        _fsdp_dims((embed, stages, head), options.data_axis),
    )


class _Raw(NamedTuple):
    """The window's sums before normalisation.

    Attributes:
      sums: the :class:`LossOut` summed over micro-batches and devices.
      per_micro: each device's per-micro-batch loss and weight,
        ``(S, D, M)`` (the last stage's device's are the losses).
      grads: the gradient of the loss sum, ``(embed, stages, head)``, the
        stages in their ``(R, S, ...)`` layout, in the accumulation dtype.
      probes: with ``report_stats``, the per-tick squared norms, else None.
    """

    sums: LossOut
    per_micro: LossOut
    grads: tuple
    probes: Probes | None


def _layout_specs(prepared: _Prepared, options: PipelineOptions) -> tuple:
    """The ``shard_map`` in_specs of ``(embed, stages, head)``: stages
    ``(R, S, ...)`` over the stage axis on axis 1, and every leaf sharded
    over the data axis (FSDP) on the dimension its parameter is."""

    def spec(lead: tuple, ndim: int, dim: int) -> PartitionSpec:
        entries = [*lead, *([None] * (ndim - len(lead)))]
        if dim >= 0:
            entries[dim + len(lead) - (1 if lead else 0)] = options.data_axis
        return PartitionSpec(*entries)

    embed_dims, stage_dims, head_dims = prepared.fsdp_dims
    embed, stages, head = prepared.like
    lead = (None, options.stage_axis)
    return (
        jax.tree.map(lambda p, d: spec((), p.ndim, d), embed, embed_dims),
        jax.tree.map(lambda p, d: spec(lead, p.ndim + 2, d), stages, stage_dims),
        jax.tree.map(lambda p, d: spec((), p.ndim, d), head, head_dims),
    )


def _probes(
    prepared: _Prepared, options: PipelineOptions
) -> tuple[Probes | None, PartitionSpec | None]:
    """With ``report_stats``, the :class:`Probes` (zeros) and their spec."""
    if not options.report_stats:
        return None, None
    schedule = prepared.schedule
    devices = (schedule.num_stages, prepared.shards)
    per_micro = jnp.zeros((*devices, options.num_microbatches), jnp.float32)
    per_tick = jnp.zeros((*devices, schedule.num_ticks), jnp.float32)
    spec = PartitionSpec(options.stage_axis, options.data_axis)
    return _place(Probes(per_micro, per_tick, per_micro), prepared.mesh, spec), spec


def _differentiate(
    prepared: _Prepared, options: PipelineOptions, params: tuple, batch, key
) -> _Raw:
    """The pipelined loss sum and its gradient: autodiff through the
    ``shard_map``'d scan. The parameters are laid out for the stage axis in
    their own dtype, then cast up to the accumulation dtype, so their
    gradients accumulate and are reduced (once, at the ``shard_map``'s
    boundary) in it."""
    mesh, schedule = prepared.mesh, prepared.schedule
    specs = _layout_specs(prepared, options)
    embed, stages, head = params
    stages = jax.tree.map(
        lambda p, spec: _reshape(
            p, (schedule.repeats, schedule.num_stages, *p.shape[1:]), mesh, spec
        ),
        stages,
        specs[1],
    )
    embed, head = (
        jax.tree.map(lambda p, spec: _place(p, mesh, spec), tree, tree_specs)
        for tree, tree_specs in ((embed, specs[0]), (head, specs[2]))
    )
    embed, stages, head = jax.tree.map(
        lambda p: p.astype(accum_dtype_for(p.dtype, options.accum_dtype)),
        (embed, stages, head),
    )
    batch = _place(batch, mesh, PartitionSpec(options.data_axis))
    key = _place(key, mesh, PartitionSpec())
    probes, probe_spec = _probes(prepared, options)
    on_device = functools.partial(
        _on_device,
        prepared.calls,
        options,
        schedule,
        prepared.shapes,
        prepared.fsdp_dims,
    )
    run = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(specs, probe_spec, PartitionSpec(options.data_axis), PartitionSpec()),
        out_specs=(
            PartitionSpec(),
            (PartitionSpec(), PartitionSpec(options.stage_axis, options.data_axis)),
        ),
        axis_names=set(options.manual_axes),
    )
    argnums = (0, 1) if options.report_stats else 0
    (_, (sums, per_micro)), grads = jax.value_and_grad(
        lambda p, q: run(p, q, batch, key), argnums, has_aux=True
    )((embed, stages, head), probes)
    grads, probe_grads = grads if options.report_stats else (grads, None)
    return _Raw(sums, per_micro, grads, probe_grads)


def _like_params(grads: tuple, params: tuple, prepared: _Prepared) -> tuple:
    """Gradients in the parameters' dtypes, shapes (the stages back from
    their ``(R, S, ...)`` layout) and, on an Explicit mesh, shardings: a
    parameter's own, else the pipeline's (stages over the stage axis)."""
    mesh = prepared.mesh
    stage_spec = PartitionSpec(prepared.stage_axis)

    def like(grad: jax.Array, param: Any, spec: PartitionSpec) -> jax.Array:
        grad = grad.astype(jnp.result_type(param))
        if not _explicit(mesh):  # the parameters' shardings are not visible
            grad = jnp.reshape(grad, jnp.shape(param))
            return lax.with_sharding_constraint(grad, NamedSharding(mesh, spec))
        own = _split.explicit_sharding(jax.typeof(param))
        sharding = own or NamedSharding(mesh, spec)
        if grad.shape != jnp.shape(param):
            grad = jnp.reshape(grad, jnp.shape(param), out_sharding=sharding)
        return jax.sharding.reshard(grad, sharding)

    embed, stages, head = grads
    return (
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), embed, params[0]),
        jax.tree.map(lambda g, p: like(g, p, stage_spec), stages, params[1]),
        jax.tree.map(lambda g, p: like(g, p, PartitionSpec()), head, params[2]),
    )


def _normalize(raw: _Raw, prepared: _Prepared, options: PipelineOptions):
    """The window's value, aux and gradients (accumulation dtype) from its
    sums: means over the ``M D`` micro-batch pieces, sums as they are,
    weighted sums over the window's total weight."""
    num_means = options.num_microbatches * prepared.shards
    totals = (raw.sums.loss, raw.grads)
    if options.reduction == "weighted":
        value, grads = divide_by_total_weight(totals, raw.sums.weight)
    elif options.reduction == "mean":
        value, grads = jax.tree.map(lambda total: total / num_means, totals)
    else:
        value, grads = totals
    aux = raw.sums.aux
    if options.aux_reduction == "mean":
        aux = jax.tree.map(lambda total: total / num_means, aux)
    value, aux = jax.tree.map(
        lambda x, own: x.astype(own.dtype),
        (value, aux),
        (prepared.own.loss, prepared.own.aux),
    )
    return value, aux, grads


def _tick_microbatches(schedule: Schedule) -> np.ndarray:
    """``(S, T, M)`` bool: which micro-batch device ``d`` carries at tick ``t``."""
    stage = np.arange(schedule.num_stages)[:, None]
    iteration = np.arange(schedule.num_ticks)[None, :] - stage
    valid = (iteration >= 0) & (
        iteration < schedule.num_microbatches * schedule.repeats
    )
    micro = np.where(valid, iteration % schedule.num_microbatches, -1)
    return micro[..., None] == np.arange(schedule.num_microbatches)


def _stats(raw: _Raw, prepared: _Prepared, options: PipelineOptions) -> WindowStats:
    """:class:`WindowStats` from each micro-batch piece's (data shard ``j``,
    micro-batch ``k``) squared gradient norm: its embedding's, its stages'
    and its head's, each taken at the one tick that computed it."""
    schedule, num = prepared.schedule, options.num_microbatches
    # Per (stage, shard, tick), a few floats: replicated, to be sliced.
    probes, per_micro = _place(
        (raw.probes, raw.per_micro), prepared.mesh, PartitionSpec()
    )
    assert probes is not None
    carries = jnp.asarray(_tick_microbatches(schedule))[:, None]  # (S, 1, T, M)
    stage_sq = jnp.sum(jnp.where(carries, probes.stage[..., None], 0.0), (0, 2))
    piece_sq = probes.embed[0] + stage_sq + probes.head[-1]
    losses = per_micro.loss[-1]
    if options.reduction == "weighted":
        weight = per_micro.weight[-1].astype(jnp.float32)
    else:
        weight = jnp.full(piece_sq.shape, prepared.rows, jnp.float32)
    finite = jnp.isfinite(losses) & jnp.isfinite(piece_sq)
    micro = MicroStats(finite.reshape(-1), piece_sq.reshape(-1), weight.reshape(-1))
    stats = window_stats(micro, squared_norm(raw.grads), options.reduction, ())
    by_shard = functools.partial(jnp.reshape, shape=(prepared.shards, num))
    return stats._replace(
        microbatch_grad_sq_norm=jnp.mean(by_shard(stats.microbatch_grad_sq_norm), 0),
        small_batch=jnp.sum(by_shard(stats.small_batch), 0),
        microbatch_finite=jnp.all(by_shard(stats.microbatch_finite), 0),
    )


def _unpack(params: Any) -> tuple:
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


def _refuse_fp8_metadata(params: tuple) -> None:
    """FP8 metadata is refused: the pipeline averages every leaf and
    differentiates each micro-batch at its own scale (issue 43 routes it
    through the window, which maxes the metadata)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if _metadata.is_metadata(path, leaf):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is FP8 metadata (Flax's "
                f"{_metadata.OVERWRITE_WITH_GRADIENT} collection): the pipeline "
                "would average it like a gradient, where the window's amax "
                "history is the max over its micro-batches. Pipeline "
                "FP8-free stages, or accumulate FP8 models with "
                "jaxaccum.value_and_grad or shard_value_and_grad."
            )


def make_pipeline(
    functions: tuple, options: PipelineOptions, mesh: Mesh | AbstractMesh | None
) -> Callable[..., Any]:
    """The step of :func:`pipeline_value_and_grad` for ``options``;
    ``functions`` is ``(stage_fn, loss_fn, embed_fn)``."""
    if mesh is not None:  # fail at construction where the mesh is known
        options.schedule(resolve_mesh(mesh, options))

    def step(params: Any, batch: Any, key: Any = None) -> Any:
        params = _unpack(params)
        _refuse_fp8_metadata(params)
        if key is not None and not any(map(takes_key, functions)):
            raise TypeError(
                "The step was given a key, but none of stage_fn, loss_fn and "
                "embed_fn takes a keyword argument `key`: it would be unused. "
                "Give the functions that draw random numbers a `key` parameter "
                "(e.g. stage_fn(params, x, key)), or call the step without one."
            )
        prepared = _prepare(functions, options, mesh, (params, batch, key))
        raw = jax.jit(functools.partial(_differentiate, prepared, options))(
            params, batch, key
        )
        value, aux, grads = _normalize(raw, prepared, options)
        grads = _like_params(grads, params, prepared)
        result = ((value, aux), grads) if options.has_aux else (value, grads)
        if options.report_stats:
            return result, _stats(raw, prepared, options)
        return result

    return step


def pipeline_value_and_grad(
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    stage_axis: str = "stage",
    embed_fn: Callable[..., Any] | None = None,
    repeats: int = 1,
    data_axis: str | None = None,
    reduction: str = "mean",
    has_aux: bool = False,
    aux_reduction: str = "mean",
    accum_dtype: Any = jnp.float32,
    remat: Any = False,
    report_stats: bool = False,
    unroll: int | bool = 1,
) -> Callable[..., Any]:
    """Pipeline parallelism where the accumulation window is the pipeline.

    The batch's ``M`` strided micro-batches (``k``: examples ``k, k + M,
    ...``) flow through ``S R`` stages on the mesh's stage axis (``S``
    devices; stage ``r S + d`` on device ``d``) in one ``lax.scan`` of
    ``M R + S - 1`` ticks, backward by autodiff through it. The result equals
    ``jax.value_and_grad`` of the model run sequentially on the whole batch,
    reduced as :func:`jaxaccum.value_and_grad` does; gradients accumulate in
    ``accum_dtype`` and come back in the parameters' dtypes, shapes and
    shardings. Bubbles compute on masked inputs whose results and gradients
    are selected away (``jnp.where``). In the loop the only collectives are
    ``collective-permute`` s to the next stage's device; gradients are
    reduced once, after it. The schedule, the bubble, memory, FSDP and
    keys: docs/guides/pipeline.md.

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> x``, one stage, given its slice
        of ``stage_params``; keeps ``x``'s structure, shapes and dtypes.
      loss_fn: ``loss_fn(head_params, x, micro_batch) -> loss``: the mean
        loss of the micro-batch (see ``reduction``); ``(loss, aux)`` with
        ``has_aux``.
      num_microbatches: ``M``; ``M D`` must divide the batch. ``M < S`` is
        allowed with ``repeats=1``; ``repeats > 1`` needs ``M >= S``.
      mesh: a mesh with ``stage_axis`` (and ``data_axis``); by default the
        one set with ``jax.set_mesh``.
      stage_axis: the mesh axis of size ``S`` the stages are placed on.
      embed_fn: ``embed_fn(embed_params, micro_batch) -> x``; None: ``x`` is
        the micro-batch.
      repeats: ``R``, stages per device (circular schedule).
      data_axis: a mesh axis the batch is sharded over, or None.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      aux_reduction: ``"mean"`` or ``"sum"`` of aux over micro-batches and
        data shards.
      accum_dtype: dtype gradients accumulate in (at least); None: their own.
      remat: ``True`` or a checkpoint policy: calls are rematerialised, the
        loop saves only each tick's stage input.
      report_stats: also return a :class:`jaxaccum.WindowStats`, as
        :func:`jaxaccum.shard_value_and_grad` does.
      unroll: passed to ``jax.lax.scan``.

    Returns:
      ``step(params, batch, key=None)``, ``params = (embed_params,
      stage_params, head_params)`` (each leaf of ``stage_params`` stacking the
      ``S R`` stages on axis 0), returning ``(loss, grads)``, ``((loss, aux),
      grads)`` with ``has_aux``, and ``(that, stats)`` with ``report_stats``.
      Given a PRNG ``key``, each function with a ``key`` parameter gets
      ``key=``: micro-batch ``k``'s ``split(key, M)[k]`` (after folding in
      the data shard's index), folded with ``l`` for stage ``l``, ``S R`` for
      ``embed_fn``, ``S R + 1`` for ``loss_fn``: the same on whichever tick or
      device it runs.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> mesh = jax.make_mesh((1,), ("stage",))  # one device: S = 1
      >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
      >>> loss_fn = lambda h, x, batch: jnp.mean((x @ h - batch["y"]) ** 2)
      >>> step = jaxaccum.pipeline_value_and_grad(stage_fn, loss_fn, 4, mesh=mesh,
      ...     embed_fn=lambda e, batch: batch["x"] @ e, repeats=2)
      >>> params = (jnp.eye(3), jnp.full((2, 3, 3), 0.5), jnp.ones(3))
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> loss, grads = jax.jit(step)(params, batch)
      >>> def sequential(params, batch):
      ...     embed, stages, head = params
      ...     x = stage_fn(stages[1], stage_fn(stages[0], batch["x"] @ embed))
      ...     return loss_fn(head, x, batch)
      >>> expected = jax.value_and_grad(sequential)(params, batch)
      >>> jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), (loss, grads), expected)
      (True, (True, True, True))
    """
    options = PipelineOptions(
        num_microbatches=num_microbatches,
        stage_axis=stage_axis,
        data_axis=data_axis,
        repeats=repeats,
        reduction=reduction,
        has_aux=has_aux,
        aux_reduction=aux_reduction,
        accum_dtype=accum_dtype,
        remat=remat,
        report_stats=report_stats,
        unroll=unroll,
    )
    return make_pipeline((stage_fn, loss_fn, embed_fn), options, mesh)
