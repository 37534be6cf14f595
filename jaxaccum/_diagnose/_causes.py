"""The causes :func:`jaxaccum.testing.diagnose` names, each with what it
measured and the fix."""

from collections.abc import Hashable

import jax
import numpy as np

from jaxaccum._diagnose._diagnosis import Cause, LeafError
from jaxaccum._window._spec import WindowSpec

# How close the gradient scale must be to N or 1 / N to be named as such.
SCALE_MATCH = 1e-2


def metadata_cause(errors: tuple[LeafError, ...]) -> Cause:
    worst = max(
        (error for error in errors if error.rule == "max"),
        key=lambda error: error.max_rel_error,
    )
    return Cause(
        "metadata",
        f"The gradients match, but FP8 metadata does not: {worst.path} is "
        f"{worst.max_rel_error:.3g} of its full-batch value away. The window "
        "combines the _overwrite_with_gradient collection by max over its "
        "micro-batches, which gives the full batch's value for amax "
        "histories and the scales computed from the window-start ones; a "
        "leaf there whose new value is not a max (a mean, a count, a scale "
        "from this batch's amax) differs. Keep only such maxima there, or "
        "compute the rest from them after the window.",
    )


def random_cause(change: float) -> Cause:
    return Cause(
        "random",
        f"fun's gradient depends on its PRNG key (key_argnums): with another "
        f"key the full-batch gradient changes by up to {change:.3g} (relative). "
        "Micro-batch k draws with jax.random.split(key, N)[k], so random "
        "draws such as dropout masks differ from the full batch's and the "
        "results cannot be compared. Diagnose (and test) with the randomness "
        "off, e.g. deterministic=True or a dropout rate of 0.",
    )


def scale_cause(scale: float, num: int, reduction: str) -> Cause:
    measured = f"The accumulated gradient is {scale:.4g} times the full-batch gradient"
    if abs(scale * num - 1) < SCALE_MATCH:
        measured += f": 1/N times (N={num})."
        fixes = {
            "mean": "fun returns a sum over its batch, but reduction='mean' "
            "averages the N micro-batch sums. Use reduction='sum', or return a "
            "mean (jnp.mean rather than jnp.sum).",
            "weighted": "the weight fun returns does not count what loss_sum "
            "sums (a constant?). Return the number (or total weight) of the "
            "summed losses, e.g. with jaxaccum.masked_sum(losses, mask).",
        }
    elif abs(scale / num - 1) < SCALE_MATCH:
        measured += f": N times (N={num})."
        fixes = {
            "sum": "fun returns a mean over its batch, but reduction='sum' adds "
            "the N micro-batch means. Use reduction='mean', or return a sum.",
        }
    else:
        measured += f" (N={num})."
        fixes = {}
    generic = (
        "fun normalizes its loss by a function of the size of the batch it is "
        "given other than a mean (divide by it) or a sum (don't), so micro-"
        "batches of B/N examples are normalized differently. Normalize by a "
        "constant, or return a mean (reduction='mean'), a sum ('sum') or "
        "(loss_sum, weight) ('weighted')."
    )
    return Cause("loss_scale", f"{measured} {fixes.get(reduction, generic)}")


def weights_cause(weights: np.ndarray, reduction: str) -> Cause:
    shown = ", ".join(f"{w:.3g}" for w in weights)
    measured = (
        "The full-batch gradient is the combination of the micro-batch "
        f"gradients with unequal weights [{shown}] (relative to their mean), "
    )
    if reduction == "weighted":
        fix = (
            "which the weights fun returns do not give. Return as weight the "
            "number (or total weight) of what loss_sum sums, e.g. with "
            "jaxaccum.masked_sum(losses, mask)."
        )
    else:
        fix = (
            f"but reduction='{reduction}' weighs them equally: fun is a mean "
            "over something whose count varies between micro-batches (valid "
            "tokens, unmasked examples). Return (loss_sum, weight), e.g. "
            "jaxaccum.masked_sum(losses, mask), and use reduction='weighted'."
        )
    return Cause("unequal_weights", measured + fix)


# The guide to losses that see the whole batch (gradient caching).
WHOLE_BATCH_GUIDE = "docs/guides/whole-batch.md"


def batch_dependent_cause(
    interaction: float, num: int, args: tuple, options: WindowSpec
) -> Cause:
    stats = [
        f"args[{num_arg}]{jax.tree_util.keystr(path)}"
        for num_arg in options.state_nums
        for path, _ in jax.tree_util.tree_leaves_with_path(args[num_arg])
        if "batch_stats" in jax.tree_util.keystr(path)
        or "BatchNorm" in jax.tree_util.keystr(path)
    ]
    found = ""
    if stats:
        found = f" The state holds BatchNorm statistics: {', '.join(stats[:3])}."
    fix = (
        _micro_batch_fix(num)
        if options.axis_name is None
        else _outside_axis_fix(num, options.axis_name)
    )
    return Cause(
        "batch_dependent",
        "An example's gradient depends on the other examples in its batch: "
        "moving one example changed the others' input gradients by up to "
        f"{interaction:.3g} (relative).{found} {fix}",
    )


def _micro_batch_fix(num: int) -> str:
    """The fix where the window is no axis: make it one, or decouple."""
    return (
        "A batch-dependent layer such as "
        "BatchNorm (or a loss that compares examples) sees micro-batches of "
        f"B/{num} examples, so its statistics are the micro-batch's. Give "
        "BatchNorm (or the loss's coupling: lax.all_gather, lax.psum) an axis "
        "name and pass the same axis_name= to the accumulator: the window's "
        "statistics are then the big batch's (docs/guides/flax.md#batchnorm). "
        "Or use GroupNorm or LayerNorm, exact per example, or accept "
        "micro-batch statistics. Where the examples meet only after "
        "a per-example encoder (a loss with in-batch negatives, a term of "
        "batch statistics such as an MoE balance term), "
        "jaxaccum.cached_value_and_grad is exact in two passes: "
        f"{WHOLE_BATCH_GUIDE}."
    )


def _outside_axis_fix(num: int, axis_name: Hashable) -> str:
    """The fix where the window is the axis ``axis_name``: the coupling that
    its collectives carry is the big batch's, so some other is not."""
    return (
        f"With axis_name={axis_name!r}, what fun couples through collectives "
        "over that axis is the big batch's, so some coupling bypasses them: a "
        f"statistic of the micro-batch's own B/{num} examples (jnp.mean or "
        "jnp.var over its batch axis) used as it is or combined nonlinearly "
        "with a collective's result (the lax.pmean of the micro-batches' "
        "variances is not the batch's variance: take the pmean of the means "
        "and of the squares, then combine), a BatchNorm or loss without the "
        "axis name, or a lax.axis_index read as if the window had one member. "
        "Write each statistic over the batch as a collective over the axis "
        "of the micro-batch's sums or means."
    )


def unexplained_cause(interaction: float | None, relative_error: float) -> Cause:
    notes = []
    if interaction is None:
        notes.append(
            "The batch has no float leaves to test whether examples interact "
            "(as behind BatchNorm)."
        )
    if relative_error < 1e-3:
        notes.append(
            f"The error is small ({relative_error:.2g} of the gradient's norm): it "
            "may be rounding (low-precision dtypes); check the tolerances."
        )
    return Cause(
        "unexplained",
        "The error is not a scale, unequal micro-batch weights, randomness or "
        "an interaction between examples. " + " ".join(notes),
    )
