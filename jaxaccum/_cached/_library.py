"""What the cached window takes from the library's core, imported here once:
the window spec and its validators, the strided split, the call checks, the
accumulation dtypes, and shard_value_and_grad's mesh, data axes and window
per device. The other modules of the package import from here."""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from jaxaccum._shard._shard import (
    call_mesh,
    data_axes_of,
    per_device_options,
    resolve_mesh,
)
from jaxaccum._shard._shard_map import rows_over_devices, run_per_device
from jaxaccum._types import CachedKwargs, PyTree
from jaxaccum._window._accum_dtypes import accum_dtype_for, zeros_like_aval
from jaxaccum._window._call_checks import check_arg_count, check_differentiable_args
from jaxaccum._window._micro_result import aux_pair, checked_loss
from jaxaccum._window._microbatch import fold_device_index, microbatch_keys
from jaxaccum._window._shard_spec import SHARD_OPTIONS
from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._split import (
    StridedBatch,
    batch_size_of,
    check_sharded_split,
    explicit_sharding,
    resolve_num_microbatches,
    spec_names,
    strided_batch,
    strided_view,
    take_microbatch,
)

__all__ = [
    "CachedWindow",
    "WindowSpec",
    "accum_dtype_for",
    "aux_pair",
    "batch_size_of",
    "cached_spec",
    "call_mesh",
    "check_arg_count",
    "checked_loss",
    "check_differentiable_args",
    "data_axes_of",
    "explicit_sharding",
    "fold_device_index",
    "per_device_options",
    "resolve_mesh",
    "rows_over_devices",
    "run_per_device",
    "spec_names",
    "strided_view",
    "take_microbatch",
    "window_of",
    "zeros_like_aval",
]

_BATCH_COUPLED = (
    "the loss sees the whole batch once, so there is nothing to reduce over "
    "micro-batches"
)

# The core's options that have no meaning here, each with why and what to do.
REFUSED: dict[str, str] = {
    **SHARD_OPTIONS,
    "reduction": f"{_BATCH_COUPLED}: loss returns the whole batch's value.",
    "aux_reduction": f"{_BATCH_COUPLED}: aux is the loss's, computed once.",
    "state_argnums": "an encoder with mutable state is refused. BatchNorm's "
    "statistics would be each micro-batch's, not the big batch's, so the "
    "result would not be the big batch's gradient; use LayerNorm or GroupNorm "
    "in the encoder, or BatchNorm with its running averages "
    "(use_running_average=True), and pass its statistics as a non-batch "
    "argument.",
    "pad": "the whole-batch loss has no per-example mask to apply: pass a "
    "batch that N divides, or return a per-example mask from encode and "
    "apply it in loss.",
    "masked": "every micro-batch's outputs are needed for the loss: pass the "
    "batch that the window holds.",
    "loss_scale": "the loss runs once on outputs in accum_dtype; scale "
    "nothing, or use jaxaccum.value_and_grad for a float16 loss scale.",
    "remat": "pass 2 already recomputes each micro-batch's forward; "
    "jax.checkpoint inside encode to save more.",
    "report_finite": "check the value and gradients it returns with jnp.isfinite.",
    "report_stats": "the window sums pullbacks of one whole-batch loss, not "
    "micro-batch gradients, so it has no micro-batch moments to report.",
    "axis_name": "the loss already sees the whole batch's outputs; for a loss "
    "written with collectives (all_gather, BatchNorm's axis_name), use "
    "jaxaccum.value_and_grad(fun, N, axis_name=...).",
}


def cached_spec(
    num_microbatches: int | None,
    options: Mapping[str, Any],
    data_axes: tuple[str, ...] = (),
) -> WindowSpec:
    """The window of a :func:`jaxaccum.cached_value_and_grad` call, validated
    as every front end's is, the options above refused by name; with
    ``data_axes``, a window per device over them."""
    # data_axes set after the keywords' check, so that a data_axes= slip is
    # an unknown keyword (did you mean data_axis?).
    spec = WindowSpec.create(
        "cached_value_and_grad",
        num_microbatches,
        options,
        CachedKwargs,
        refused=REFUSED,
    )
    return spec.resharded(data_axes=data_axes) if data_axes else spec


class CachedWindow(NamedTuple):
    """A call's batch split into micro-batches, and their keys.

    Attributes:
      num_microbatches: ``N``.
      microbatch_size: rows per micro-batch, ``B // N``.
      batch: the batch argument(s) as a strided view: micro-batch ``k``
        holds examples ``k, k + N, ...`` (the core's split, not copied).
      keys: each key argument split into ``N`` keys as the core splits them
        (the key itself, stacked once, at ``N = 1``); a scan's ``xs``.
    """

    num_microbatches: int
    microbatch_size: int
    batch: StridedBatch
    keys: tuple

    def microbatch(self, index: jax.typing.ArrayLike) -> PyTree:
        """The batch argument(s) of micro-batch ``index``, a tuple."""
        return self.batch.microbatch(index)


def window_of(args: tuple, spec: WindowSpec) -> CachedWindow:
    """The call's :class:`CachedWindow`, its batch checked as the core checks it.

    Raises:
      ValueError: for batch leaves of unequal sizes, or a batch ``N`` does not
        divide (listing the ``N`` that do).
    """
    check_arg_count(args, spec)
    labelled = [(f"args[{i}]", args[i]) for i in spec.batch_nums]
    split = resolve_num_microbatches(
        batch_size_of(labelled),
        spec.num_microbatches,
        spec.microbatch_size,
        can_pad=False,
    )
    num = split.num_microbatches
    if num > 1:
        check_sharded_split(labelled, split.padded_size, num)
    keys = microbatch_keys(key_args(args, spec), num)
    batch = strided_batch(tuple(args[i] for i in spec.batch_nums), num)
    return CachedWindow(num, split.microbatch_size, batch, keys)


def key_args(args: tuple, spec: WindowSpec) -> tuple:
    return tuple(args[i] for i in spec.key_nums)
