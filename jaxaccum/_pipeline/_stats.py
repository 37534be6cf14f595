"""The pipeline's reports: the probes (inputs whose cotangents are each
piece's squared gradient norm), and the :class:`jaxaccum.WindowStats` and
:class:`jaxaccum.FiniteReport` read off them: each micro-batch's squared
gradient norm, whole although the pipeline computes it in pieces (its
embedding's, each stage's at its tick, its head's)."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxaccum._pipeline._device import Probes
from jaxaccum._pipeline._layout import Prepared, place
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._types import PyTree
from jaxaccum._window._micro_result import FiniteReport
from jaxaccum._window._noise_scale import (
    MicroStats,
    WindowStats,
    squared_norm,
    window_stats,
)


def pipeline_stats(
    raw: PyTree, prepared: Prepared, options: PipelineWindow
) -> WindowStats:
    """:class:`WindowStats` of a window's raw sums ``raw`` (its ``probes``,
    ``per_micro`` and ``grads``) from each micro-batch piece's (data shard ``j``,
    micro-batch ``k``) squared gradient norm: its embedding's, its stages'
    and its head's, each taken at the one tick that computed it."""
    schedule, num = prepared.schedule, prepared.schedule.num_microbatches
    # Per (stage, shard, tick), a few floats: replicated, to be sliced.
    probes, per_micro = place(
        (raw.probes, raw.per_micro), prepared.mesh, PartitionSpec()
    )
    assert probes is not None
    carries = jnp.asarray(schedule.stage_gradient_table())[:, None]  # (S, 1, T, M)
    stage_sq = jnp.sum(jnp.where(carries, probes.stage[..., None], 0.0), (0, 2))
    last = schedule.loss_device  # the loss's device: its head probe too
    piece_sq = probes.embed[0] + stage_sq + probes.head[last]
    losses = per_micro.loss[last]
    if options.reduction == "weighted":
        weight = per_micro.weight[last].astype(jnp.float32)
    else:
        weight = jnp.full(piece_sq.shape, prepared.rows, jnp.float32)
    finite = jnp.isfinite(losses) & jnp.isfinite(piece_sq)
    micro = MicroStats(finite.reshape(-1), piece_sq.reshape(-1), weight.reshape(-1))
    # window_stats normalises the squared norm of the window's gradient sum.
    positive = raw.share > 0
    sum_sq = squared_norm(raw.grads) / jnp.where(positive, raw.share, 1) ** 2
    stats = window_stats(micro, jnp.where(positive, sum_sq, 0), options.reduction, ())
    by_shard = functools.partial(jnp.reshape, shape=(prepared.shards, num))
    return stats._replace(
        microbatch_grad_sq_norm=jnp.mean(by_shard(stats.microbatch_grad_sq_norm), 0),
        small_batch=jnp.sum(by_shard(stats.small_batch), 0),
        microbatch_finite=jnp.all(by_shard(stats.microbatch_finite), 0),
    )


def probed(options: PipelineWindow) -> bool:
    """Whether the window probes each micro-batch's gradient (its squared
    norm, and so whether it is finite)."""
    return options.report_stats or options.report_finite


def make_probes(
    prepared: Prepared, options: PipelineWindow, loss_scale: jax.Array | None
) -> tuple[Probes | None, PartitionSpec | None]:
    """With ``report_stats`` or ``report_finite``, the :class:`Probes` and
    their spec. Their values are what each piece's gradient is divided by
    before it is squared: the loss scale, or 1."""
    if not probed(options):
        return None, None
    schedule = prepared.schedule
    devices = (schedule.num_stages, prepared.shards)
    divisor = jnp.float32(1) if loss_scale is None else loss_scale
    divisor = jnp.asarray(divisor, jnp.float32)
    per_micro = jnp.full((*devices, schedule.num_microbatches), divisor)
    per_tick = jnp.full((*devices, schedule.num_ticks), divisor)
    spec = PartitionSpec(options.layout.stage_axis, options.layout.data_axis)
    return place(Probes(per_micro, per_tick, per_micro), prepared.mesh, spec), spec


def unshared(probes: Probes | None, share: jax.Array) -> Probes | None:
    """The probes' squared norms of the loss's own gradient: divided by the
    share twice (not by its square, which underflows sooner)."""
    positive = share > 0
    safe = jnp.where(positive, share, 1)
    return jax.tree.map(lambda q: jnp.where(positive, q / safe / safe, 0), probes)


def window_report(raw: PyTree, prepared: Prepared, options: PipelineWindow) -> PyTree:
    """The window's :class:`WindowStats` (``report_stats``), its
    :class:`FiniteReport` (``report_finite``: a micro-batch's loss and
    gradient finite), else ``()``."""
    if not probed(options):
        return ()
    stats = pipeline_stats(raw, prepared, options)
    if options.report_finite:
        return FiniteReport(stats.microbatch_finite, stats.finite)
    return stats
