"""What every schedule's window is run with and returns: the parameters laid
out on the mesh, the device body under ``shard_map``, the window's share,
and :class:`Raw`, the sums and gradient before normalisation."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxaccum._pipeline._calls import LossOut
from jaxaccum._pipeline._device import Probes, Static
from jaxaccum._pipeline._layout import Prepared, layout_specs, place, reshape
from jaxaccum._pipeline._spec import PipelineWindow
from jaxaccum._precision._loss_scale import tree_finite, unscale
from jaxaccum._window._accum_dtypes import accum_dtype_for
from jaxaccum._window._micro_result import microbatch_share


class Run(NamedTuple):
    """One call's window, as a schedule runs it.

    Attributes:
      prepared: the call's checked arguments (mesh, schedule, shapes).
      options: the call's options.
      bubble_fill: what bubbles compute on (tests poison it with NaN).
      skip_bubbles: whether a schedule that can skip a bubble's slots with
        ``lax.cond`` does (else they compute on the fill, selected away).
    """

    prepared: Prepared
    options: PipelineWindow
    bubble_fill: float = 0.0
    skip_bubbles: bool = True

    @property
    def num_means(self) -> int:
        """``M D``: the window's micro-batch pieces."""
        return self.prepared.schedule.num_microbatches * self.prepared.shards

    def static(self) -> Static:
        """What every device's window is built from."""
        prepared = self.prepared
        return Static(
            prepared.calls,
            self.options,
            prepared.schedule,
            prepared.shapes,
            prepared.fsdp_dims,
            self.bubble_fill,
        )

    def device_spec(self) -> PartitionSpec:
        """A per-device output's spec: one entry per (stage, data shard)."""
        layout = self.options.layout
        return PartitionSpec(layout.stage_axis, layout.data_axis)

    def params_specs(self) -> tuple:
        """The ``shard_map`` specs of ``(embed, stages, head)``."""
        return layout_specs(self.prepared, self.options)

    def per_device(self, window: Any, **specs: Any) -> Any:
        """``window`` under ``shard_map`` on the step's mesh, manual over the
        pipeline's axes (``specs``: its ``in_specs`` and ``out_specs``)."""
        axes = set(self.options.layout.manual_axes)
        return jax.shard_map(window, mesh=self.prepared.mesh, axis_names=axes, **specs)

    def share(self, weight: Any, dtype: Any) -> jax.Array:
        """What the window's loss sum is multiplied by before its backward
        pass, so that every cotangent is the big batch's: the core's
        :func:`microbatch_share` with the whole window as one piece of
        ``M D`` means. Every forward pass runs before its backward pass in
        the window, so a weighted window's total weight ``W`` is known: its
        share is exactly ``1 / W`` (0 at weight 0). In ``dtype``, at least
        float32."""
        pieces = 1 if self.options.reduction == "weighted" else self.num_means
        return microbatch_share(self.options, pieces, weight, dtype)

    def laid_out(self, params: tuple, batch: Any, key: Any) -> tuple:
        """``params``, ``batch`` and ``key`` placed on the mesh: the stages
        laid out ``(R, S, ...)`` over the stage axis in their own dtype, then
        every parameter cast up to the accumulation dtype (their gradients
        accumulate and are reduced in it); the batch over the data axis, the
        key replicated."""
        prepared, options = self.prepared, self.options
        mesh = prepared.mesh
        specs = self.params_specs()
        embed, stages, head = params
        stages = jax.tree.map(self._stacked, stages, specs[1])
        embed, head = (
            jax.tree.map(lambda p, spec: place(p, mesh, spec), tree, tree_specs)
            for tree, tree_specs in ((embed, specs[0]), (head, specs[2]))
        )
        params = jax.tree.map(
            lambda p: p.astype(accum_dtype_for(p.dtype, options.accum_dtype)),
            (embed, stages, head),
        )
        batch = place(batch, mesh, PartitionSpec(options.layout.data_axis))
        return params, batch, place(key, mesh, PartitionSpec())

    def _stacked(self, stage: jax.Array, spec: PartitionSpec) -> jax.Array:
        """A stacked ``(S R, ...)`` leaf as ``(R, S, ...)``, ``spec``'s
        layout: from model order a reshape (XLA moves rows between the
        devices when ``R > 1``), from device order a reshape and a transpose
        that leave each device its own rows."""
        mesh, schedule = self.prepared.mesh, self.prepared.schedule
        repeats, stages = schedule.repeats, schedule.num_stages
        if self.options.layout.stage_order == "model":
            return reshape(stage, (repeats, stages, *stage.shape[1:]), mesh, spec)
        own = PartitionSpec(spec[1], spec[0], *spec[2:])
        held = reshape(stage, (stages, repeats, *stage.shape[1:]), mesh, own)
        return place(jnp.swapaxes(held, 0, 1), mesh, spec)


class Raw(NamedTuple):
    """The window's sums before normalisation.

    Attributes:
      sums: the :class:`LossOut` summed over micro-batches and devices.
      per_micro: each device's per-micro-batch loss and weight,
        ``(S, D, M)`` (the losses are the schedule's ``loss_device``'s: the last
        stage's device's, v-zb's first).
      grads: the gradient of the loss sum, ``(embed, stages, head)``, the
        stages in their ``(R, S, ...)`` layout, in the accumulation dtype.
      probes: with ``report_stats`` or ``report_finite``, the per-tick
        squared norms, else None.
      share: what the loss sum was multiplied by before the backward pass
        (:meth:`Run.share`): ``grads`` is the window's gradient.
      finite: with a loss scale, whether the sums and gradients (unscaled,
        reduced over every stage and data shard) are all finite, else None.
    """

    sums: LossOut
    per_micro: LossOut
    grads: tuple
    probes: Probes | None
    share: jax.Array
    finite: jax.Array | None = None

    def unscaled(self, loss_scale: jax.Array | None) -> "Raw":
        """With a loss scale, the gradients (in their dtype) divided by it
        (the probes' squared norms already were, leaf by leaf) and whether
        the window is finite; else ``self``."""
        if loss_scale is None:
            return self
        grads = jax.tree.map(
            lambda g: unscale(g, loss_scale).astype(g.dtype), self.grads
        )
        finite = tree_finite((self.sums.loss, self.sums.weight, grads))
        return self._replace(grads=grads, finite=finite)
