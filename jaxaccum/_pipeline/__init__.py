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

1F1B (``schedule="1f1b"``) runs the backward pass in the same loop: ``M + 2
(S - 1)`` ticks, each a forward and a backward slot per device, a stage's
backward the ``jax.vjp`` of its forward rebuilt from a ring of ``min(2 S -
1, M)`` saved residuals, so the activation memory is flat in ``M``.
Zero-bubble (``schedule="zero-bubble"``) splits the backward into the stage
input's cotangent (B) and the parameters' gradient (W, later, from the
residual ring and a ring of what B stored); tables built when the step is
traced put each device's F, B and W slots (ZB-H1's grid of one slot a tick,
or with remat 1F1B's ticks and the W's deferred). Interleaved
1F1B (``schedule="1f1b"`` with ``repeats > 1``) runs each device's R stages
in Megatron's order: micro-batches in groups of S through every repeat,
both rings circular.

A schedule is a strategy: one class per schedule, owning its tick table,
its device body, its ``shard_map`` and its result tail; ``_schedules`` maps
a ``schedule=`` string to its class, the one place that does.

The package, one concept per module: ``_schedule`` (the base class: forward
slots, neighbour rings, the bubble), ``_gpipe`` (``GPipe``: one device's
GPipe or circular window, embed, the ticks, the losses, backward by
autodiff), ``_1f1b`` and ``_1f1b_tick`` (``OneFOneB``: one device's 1F1B
window and one tick of it, its backward included), ``_zero_bubble`` and
``_zero_bubble_tick`` (``ZeroBubble``: its tables and one device's window;
``_zero_bubble_split``, the stage's backward split at its jaxpr),
``_interleaved`` and ``_interleaved_tick`` (``Interleaved``: its tick and
ring tables and one device's window), ``_schedules`` (the names), ``_spec``
(``PipelineWindow``: the core window and the layout), ``_calls`` (the
user's functions as the loop calls them: dtypes, keys, remat, gated
gradients), ``_device`` (what a device's window reads:
its parameters, micro-batches, keys, fill), ``_run`` (what every schedule
runs with and returns: the parameters laid out, ``shard_map``, the share),
``_layout`` (the mesh, the stacked stages, FSDP, the call's checks,
gradients laid out like the parameters), ``_stats`` (the probes and the
window's reports read off them), ``_step`` (the front end: the schedule's
run, the loss scale, normalisation) and ``_plan`` (the window's ``M``,
schedule and ``remat`` for a memory budget).
"""

from jaxaccum._pipeline._plan import plan_pipeline as plan_pipeline
from jaxaccum._pipeline._plan_result import PipelinePlan as PipelinePlan
from jaxaccum._pipeline._plan_result import PipelinePlanRow as PipelinePlanRow
from jaxaccum._pipeline._stage_order import (
    pipeline_stage_order as pipeline_stage_order,
)
from jaxaccum._pipeline._step import pipeline_value_and_grad as pipeline_value_and_grad
