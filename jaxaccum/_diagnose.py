"""Why an accumulated gradient differs from the full batch: ``testing.diagnose``."""

import dataclasses
import operator
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from typing_extensions import Unpack

from jaxaccum import _compare, _metadata, _split
from jaxaccum._options import COMPARE_REFUSED, AccumOptions
from jaxaccum._types import CompareKwargs, Fun, PyTree
from jaxaccum._value_and_grad import make_accumulated

# A cause is named when its model of the error leaves a residual under this
# fraction of the error: float32 rounding leaves ~1e-6, a wrong model ~1.
_EXPLAINED = 0.05
# Moving one example changes the others' input gradients by ~1e-7 (rounding)
# in a per-example model, by ~1 / micro-batch size behind BatchNorm.
_INTERACTION = 1e-4
# Fitted micro-batch weights this far apart (relative to their mean) are unequal.
_UNEQUAL = 1e-2
# How close the gradient scale must be to N or 1 / N to be named as such.
_SCALE_MATCH = 1e-2
_MAX_LEAVES_SHOWN = 20
_MAX_LEGEND = (
    "  (max): FP8 metadata, the max over the micro-batches, compared as a value"
)


class LeafError(NamedTuple):
    """Largest error of one leaf of ``{"value": ..., "grads": ...}``.

    :class:`Diagnosis` lists one per leaf, largest relative error first.

    Attributes:
      path: the leaf's path, as ``jax.tree_util.keystr`` writes it
        (``"['grads']['w']"``).
      max_abs_error: the largest absolute difference between the accumulated
        and the full-batch leaf.
      max_rel_error: ``max_abs_error`` divided by the full-batch leaf's largest
        absolute value.
      rule: how the window combines the leaf: ``"gradient"`` (by the
        reduction) or ``"max"`` (FP8 metadata, whose window value is the max
        of its micro-batches', compared as a value).
    """

    path: str
    max_abs_error: float
    max_rel_error: float
    rule: str = "gradient"


class Cause(NamedTuple):
    """A reason the accumulated result differs from the full batch.

    Attributes:
      kind: ``"metadata"`` (the gradients match, FP8 metadata does not: a
        leaf of the ``_overwrite_with_gradient`` collection whose window value
        is not the max of its micro-batches'), ``"loss_scale"`` (the gradient
        is a multiple of the full-batch one,
        e.g. ``N`` or ``1 / N``: a sum where a mean was expected, or the
        reverse), ``"unequal_weights"`` (the full batch weighs micro-batches
        unequally: use ``reduction="weighted"``), ``"batch_dependent"`` (an
        example's gradient depends on the other examples in its batch, as
        behind BatchNorm), ``"random"`` (the gradient depends on the PRNG key)
        or ``"unexplained"``.
      message: what was measured, what it means and what to do.
    """

    kind: str
    message: str


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    r"""The result of :func:`diagnose`; ``print`` it for a readable report.

    Attributes:
      matches: whether the accumulated value and gradients equal the full-batch
        ones within ``rtol`` and ``atol``.
      num_microbatches: ``N``.
      relative_error:
        :math:`\lVert a - f \rVert / \lVert f \rVert` (:math:`a` accumulated,
        :math:`f` full batch)
        over all gradient leaves together (Euclidean norms; FP8 metadata, not
        a gradient, left out of this and of the causes' analysis).
      leaf_errors: per leaf of ``{"value": ..., "grads": ...}``, its path and
        largest absolute and relative error.
      causes: the causes found (empty when it matches).
      rtol: relative tolerance used.
      atol: absolute tolerance used.
      gradient_scale: least-squares ratio of the accumulated to the full-batch
        gradient (``N`` or ``1 / N`` for a mean/sum mix-up); None if it matches.
      microbatch_weights: the weights (relative to their mean) with which the
        micro-batch gradients combine into the full-batch gradient, when they
        do; None if not fitted.
      interaction: how much moving one example changes the input gradients of
        the others, relative to them; None if not measured (or no float batch
        leaves to measure it with).
    """

    matches: bool
    num_microbatches: int
    relative_error: float
    leaf_errors: tuple[LeafError, ...]
    causes: tuple[Cause, ...]
    rtol: float
    atol: float
    gradient_scale: float | None = None
    microbatch_weights: tuple[float, ...] | None = None
    interaction: float | None = None

    def __str__(self) -> str:
        verdict = "match" if self.matches else "do NOT match"
        lines = [
            f"N={self.num_microbatches} micro-batches {verdict} the full batch "
            f"(rtol={self.rtol:g}, atol={self.atol:g}).",
            f"Gradient error: {self.relative_error:.3g} of the full-batch "
            "gradient's norm.",
        ]
        worst = sorted(self.leaf_errors, key=lambda error: -error.max_abs_error)
        width = max([len(error.path) for error in worst] + [4])
        lines.append(f"  {'leaf':<{width}}  max abs error  max rel error")
        lines += [
            f"  {error.path:<{width}}  {error.max_abs_error:13.3g}  "
            f"{error.max_rel_error:13.3g}" + ("  (max)" if error.rule == "max" else "")
            for error in worst[:_MAX_LEAVES_SHOWN]
        ]
        if len(worst) > _MAX_LEAVES_SHOWN:
            lines.append(f"  ... and {len(worst) - _MAX_LEAVES_SHOWN} more leaves")
        if any(error.rule == "max" for error in worst):
            lines.append(_MAX_LEGEND)
        for cause in self.causes:
            lines.append(
                textwrap.fill(
                    cause.message,
                    width=80,
                    initial_indent=f"Cause ({cause.kind}): ",
                    subsequent_indent="  ",
                )
            )
        return "\n".join(lines)


def diagnose(
    fun: Fun,
    *args: PyTree,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[CompareKwargs],
) -> Diagnosis:
    """Compares accumulation with the full batch and names why they differ.

    Computes :func:`jaxaccum.value_and_grad` with ``N`` micro-batches and with
    one (the full batch), like
    :func:`jaxaccum.testing.assert_grads_match_full_batch`, and reports the
    largest error of every leaf. When they differ, it names the first
    :class:`Cause` that explains the error, trying ``"random"``,
    ``"loss_scale"``, ``"unequal_weights"`` and ``"batch_dependent"`` (two
    more full-batch gradients) in that order, else ``"unexplained"``. How each
    is detected: [Pitfalls](../guides/pitfalls.md#how-diagnose-finds-the-cause).

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      *args: its positional arguments, batch included.
      num_microbatches: ``N``; or pass ``microbatch_size`` in the kwargs.
      rtol: relative tolerance of the comparison.
      atol: absolute tolerance of the comparison.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``argnums``, ``batch_argnums``, ``reduction``, ...).

    Returns:
      A :class:`Diagnosis`; ``print`` it for the report.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def loss(w, x):                # a sum, but reduction="mean"
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> diagnosis = jaxaccum.testing.diagnose(loss, jnp.ones(3), x,
      ...                                       num_microbatches=4)
      >>> diagnosis.matches, [cause.kind for cause in diagnosis.causes]
      (False, ['loss_scale'])
      >>> print(diagnosis)
      N=4 micro-batches do NOT match the full batch (rtol=1e-05, atol=1e-06).
      Gradient error: 0.75 of the full-batch gradient's norm.
        leaf       max abs error  max rel error
        ['value']           1.64           0.75
        ['grads']           1.34           0.75
      Cause (loss_scale): The accumulated gradient is 0.25 times the full-batch
        gradient: 1/N times (N=4). fun returns a sum over its batch, but
        reduction='mean' averages the N micro-batch sums. Use reduction='sum', or
        return a mean (jnp.mean rather than jnp.sum).
    """
    options = AccumOptions.create(
        "diagnose",
        num_microbatches,
        value_and_grad_kwargs,
        refused=COMPARE_REFUSED,
    )
    accumulated, reference = _compare.accumulated_and_reference(fun, args, options)
    metadata = _compare.metadata_paths({"grads": reference[1]})
    errors = tuple(
        LeafError(*error, rule="max" if error[0] in metadata else "gradient")
        for error in _compare.leaf_errors(
            {"value": accumulated[0], "grads": accumulated[1]},
            {"value": reference[0], "grads": reference[1]},
        )
    )
    num = _num_microbatches(args, options)
    accumulated_grads = _flat(accumulated[1])
    reference_grads = _flat(reference[1])
    error = float(np.linalg.norm(accumulated_grads - reference_grads))
    relative_error = error / max(float(np.linalg.norm(reference_grads)), 1e-30)
    report = _reporter(num, relative_error, errors, rtol, atol)
    if _close(accumulated, reference, rtol, atol):
        return report(matches=True, causes=())
    if metadata and error <= atol + rtol * float(np.linalg.norm(reference_grads)):
        return report(matches=False, causes=(_metadata_cause(errors),))

    if options.key_nums:
        change = _key_sensitivity(fun, args, reference, options)
        if change > rtol:
            return report(matches=False, causes=(_random_cause(change),))

    scale = _least_squares_scale(accumulated_grads, reference_grads)
    residual = np.linalg.norm(accumulated_grads - scale * reference_grads)
    if residual <= _EXPLAINED * error:
        cause = _scale_cause(scale, num, options.reduction)
        return report(matches=False, causes=(cause,), gradient_scale=scale)

    weights = _microbatch_weights(fun, args, num, reference_grads, error, options)
    if weights is not None and np.ptp(weights) > _UNEQUAL:
        return report(
            matches=False,
            causes=(_weights_cause(weights, options.reduction),),
            gradient_scale=scale,
            microbatch_weights=tuple(float(w) for w in weights),
        )

    interaction = _interaction(fun, args, options)
    if interaction is not None and interaction > _INTERACTION:
        cause = _batch_dependent_cause(interaction, num, args, options)
    else:
        cause = _unexplained_cause(interaction, relative_error)
    return report(
        matches=False,
        causes=(cause,),
        gradient_scale=scale,
        microbatch_weights=None if weights is None else tuple(map(float, weights)),
        interaction=interaction,
    )


def _reporter(
    num: int,
    relative_error: float,
    errors: tuple[LeafError, ...],
    rtol: float,
    atol: float,
) -> Callable[..., Diagnosis]:
    """Builds Diagnoses that share the figures every outcome reports."""

    def report(**fields: Any) -> Diagnosis:
        return Diagnosis(
            num_microbatches=num,
            relative_error=relative_error,
            leaf_errors=errors,
            rtol=rtol,
            atol=atol,
            **fields,
        )

    return report


def _num_microbatches(args: tuple, options: AccumOptions) -> int:
    batch_size = _split.batch_size_of(
        [(f"args[{i}]", args[i]) for i in options.batch_nums]
    )
    return _split.resolve_num_microbatches(
        batch_size, options.num_microbatches, options.microbatch_size, pad=options.pad
    ).num_microbatches


def _close(actual: PyTree, expected: PyTree, rtol: float, atol: float) -> bool:
    try:
        chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


def _flat(tree: PyTree) -> np.ndarray:
    """The gradient leaves of ``tree`` in one float64 vector (FP8 metadata,
    not a gradient, left out)."""
    return np.asarray(ravel_pytree(_metadata.gradient_leaves(tree))[0], np.float64)


def _least_squares_scale(actual: np.ndarray, reference: np.ndarray) -> float:
    norm = float(reference @ reference)
    return float(actual @ reference) / norm if norm else float("nan")


def _relative_change(new: PyTree, old: PyTree) -> float:
    new, old = _flat(new), _flat(old)
    return float(np.max(np.abs(new - old), initial=0.0)) / max(
        float(np.max(np.abs(old), initial=0.0)), float(np.finfo(np.float32).tiny)
    )


def _key_sensitivity(
    fun: Fun, args: tuple, reference: tuple, options: AccumOptions
) -> float:
    """Relative change of the full-batch gradient when every key is changed."""
    other_args = list(args)
    for num in options.key_nums:
        other_args[num] = jax.tree.map(
            lambda key: jax.random.fold_in(key, 1), args[num]
        )
    other = _compare.value_and_grads(fun, tuple(other_args), options.full_batch)
    return _relative_change(other[1], reference[1])


def _microbatch_weights(
    fun: Fun,
    args: tuple,
    num: int,
    reference_grads: np.ndarray,
    error: float,
    options: AccumOptions,
) -> np.ndarray | None:
    """Weights ``a`` with ``full-batch grad = sum_k a_k g_k``, relative to their
    mean, if the micro-batch gradients ``g_k`` determine them and they explain
    the error; else None."""
    batch_vals = tuple(args[i] for i in options.batch_nums)
    batch_size = _split.batch_size_of([("batch", batch_vals)])
    padded_size = _split.resolve_num_microbatches(
        batch_size, num, None, pad=options.pad
    ).padded_size
    batch = _split.strided_batch(_split.pad_batch(batch_vals, padded_size), num)
    mask_view = _split.strided_view(jnp.arange(padded_size) < batch_size, num)
    keys = [
        jax.tree.map(lambda key: jax.random.split(key, num), args[i])
        for i in options.key_nums
    ]
    micro_fun = fun
    if options.pad:
        # The micro-batch's mask rides as an extra last positional argument.
        def micro_fun(*call_args, **call_kwargs):
            return fun(*call_args[:-1], **call_kwargs, example_mask=call_args[-1])

    micro_value_and_grad = jax.jit(
        make_accumulated(micro_fun, dataclasses.replace(options.full_batch, pad=False))
    )
    call_args = list(args) + ([None] if options.pad else [])
    columns = []
    for index in range(num):
        micro_batch = batch.microbatch(index)
        for num_arg, value in zip(options.batch_nums, micro_batch, strict=True):
            call_args[num_arg] = value
        if num > 1:
            for num_arg, key in zip(options.key_nums, keys, strict=True):
                call_args[num_arg] = jax.tree.map(operator.itemgetter(index), key)
        if options.pad:
            call_args[-1] = mask_view[:, index]
        result = micro_value_and_grad(*call_args)
        if options.state_nums:
            result, new_state = result
            if isinstance(options.state_argnums, int):
                new_state = (new_state,)
            for num_arg, value in zip(options.state_nums, new_state, strict=True):
                call_args[num_arg] = value
        columns.append(_flat(result[1]))
    matrix = np.stack(columns, axis=1)
    weights, _, rank, _ = np.linalg.lstsq(matrix, reference_grads, rcond=None)
    residual = np.linalg.norm(matrix @ weights - reference_grads)
    if rank < num or residual > _EXPLAINED * error or not np.mean(weights):
        return None
    return weights / np.mean(weights)


def _interaction(fun: Fun, args: tuple, options: AccumOptions) -> float | None:
    """How much moving the last example changes the other examples' gradients."""
    leaves, treedef = jax.tree.flatten(tuple(args[i] for i in options.batch_nums))
    floats = [
        index
        for index, leaf in enumerate(leaves)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    ]
    batch_size = np.shape(leaves[0])[0]
    if not floats or batch_size < 2:
        return None

    def loss(float_leaves):
        batch_leaves = list(leaves)
        for index, leaf in zip(floats, float_leaves, strict=True):
            batch_leaves[index] = leaf
        call_args = list(args)
        for num_arg, value in zip(
            options.batch_nums, jax.tree.unflatten(treedef, batch_leaves), strict=True
        ):
            call_args[num_arg] = value
        extra = {"example_mask": jnp.ones(batch_size, bool)} if options.pad else {}
        out = fun(*call_args, **extra)
        if options.state_nums:
            out = out[0]
        if options.has_aux:
            out = out[0]
        if options.reduction == "weighted":
            out = out[0]
        return out

    def moved(index, leaf):
        leaf = jnp.asarray(leaf)
        spread = jnp.std(leaf)
        spread = jnp.where(spread > 0, spread, 1.0)
        noise = jax.random.normal(jax.random.key(index), leaf.shape[1:])
        return leaf.at[-1].add((spread * noise).astype(leaf.dtype))

    grad = jax.jit(jax.grad(loss))
    float_leaves = [leaves[index] for index in floats]
    before = grad(float_leaves)
    after = grad([moved(index, leaf) for index, leaf in enumerate(float_leaves)])
    # Only the examples that were not moved: their gradients must not change.
    return _relative_change(
        [leaf[:-1] for leaf in after], [leaf[:-1] for leaf in before]
    )


def _metadata_cause(errors: tuple[LeafError, ...]) -> Cause:
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


def _random_cause(change: float) -> Cause:
    return Cause(
        "random",
        f"fun's gradient depends on its PRNG key (key_argnums): with another "
        f"key the full-batch gradient changes by up to {change:.3g} (relative). "
        "Micro-batch k draws with jax.random.split(key, N)[k], so random "
        "draws such as dropout masks differ from the full batch's and the "
        "results cannot be compared. Diagnose (and test) with the randomness "
        "off, e.g. deterministic=True or a dropout rate of 0.",
    )


def _scale_cause(scale: float, num: int, reduction: str) -> Cause:
    measured = f"The accumulated gradient is {scale:.4g} times the full-batch gradient"
    if abs(scale * num - 1) < _SCALE_MATCH:
        measured += f": 1/N times (N={num})."
        fixes = {
            "mean": "fun returns a sum over its batch, but reduction='mean' "
            "averages the N micro-batch sums. Use reduction='sum', or return a "
            "mean (jnp.mean rather than jnp.sum).",
            "weighted": "the weight fun returns does not count what loss_sum "
            "sums (a constant?). Return the number (or total weight) of the "
            "summed losses, e.g. with jaxaccum.masked_sum(losses, mask).",
        }
    elif abs(scale / num - 1) < _SCALE_MATCH:
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


def _weights_cause(weights: np.ndarray, reduction: str) -> Cause:
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


def _batch_dependent_cause(
    interaction: float, num: int, args: tuple, options: AccumOptions
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
    return Cause(
        "batch_dependent",
        "An example's gradient depends on the other examples in its batch: "
        "moving one example changed the others' input gradients by up to "
        f"{interaction:.3g} (relative).{found} A batch-dependent layer such as "
        "BatchNorm (or a loss that compares examples) sees micro-batches of "
        f"B/{num} examples, so no single-pass accumulation reproduces the full "
        "batch. Use "
        "GroupNorm or LayerNorm to match it exactly, or accept micro-batch "
        "statistics (docs/guides/flax.md).",
    )


def _unexplained_cause(interaction: float | None, relative_error: float) -> Cause:
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
