"""What :func:`jaxaccum.testing.diagnose` reports: each leaf's error and the
cause it names, in a :class:`Diagnosis` that prints as a report."""

import dataclasses
import textwrap
from typing import NamedTuple

MAX_LEAVES_SHOWN = 20


MAX_LEGEND = (
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
            for error in worst[:MAX_LEAVES_SHOWN]
        ]
        if len(worst) > MAX_LEAVES_SHOWN:
            lines.append(f"  ... and {len(worst) - MAX_LEAVES_SHOWN} more leaves")
        if any(error.rule == "max" for error in worst):
            lines.append(MAX_LEGEND)
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
