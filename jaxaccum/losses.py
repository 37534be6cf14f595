"""Contrastive losses that never hold the B x B logits.

CLIP's and SigLIP's losses score each of B examples against every other: a
B x B matrix of logits, 17 GB of float32 at B = 65,536, which is what runs out
of memory first at contrastive batch sizes. Here forward and backward take a
block of ``block_size`` rows at a time (the backward recomputes a block's
logits rather than keeping them), so the memory is O(B·D + block_size·B).
The value and gradients are the formula's up to float32 rounding (the
summation order differs), and the value and the scale's gradient are no
further from float64 than the formula computed in float32: each is a sum of
per-row and per-column terms formed before summing, never a difference of
sums that grow with B x ``logit_scale`` (which near convergence, at CLIP's
scale of 100, cancel to a negative loss). Sums are taken in float32 for
bfloat16 or float16 inputs (float64 for float64), and gradients come back in
each input's dtype.

Neither loss normalises its inputs: pass embeddings normalised as your model
wants (CLIP and SigLIP divide each row by its norm first). ``logit_scale`` is
the multiplier itself, as in open_clip's ``ClipLoss`` and ``SigLipLoss``: a
model that learns its logarithm (CLIP's ``log(1/0.07)``) passes
``jnp.exp(log_scale)``, and the gradient flows through the ``exp``.

``jaxaccum.losses`` loads on first use (``jaxaccum.losses.softmax_contrastive``
after ``import jaxaccum``); it needs jax only.
"""

import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike

from jaxaccum._cached import _contrastive

__all__ = ["sigmoid_contrastive", "softmax_contrastive"]

# Rows per block: 512 x B logits in float32 is 32 MiB at B = 16,384 and 128
# MiB at B = 65,536, and a 512-row matrix product keeps an accelerator busy.
DEFAULT_BLOCK_SIZE = 512


def _checked_pair(name: str, x: ArrayLike, y: ArrayLike) -> tuple[Array, Array]:
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim != 2 or x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(
            f"{name}: x has shape {x.shape} and y {y.shape}; both must be (B, D) "
            "with the same B >= 1 and D (row i of x and row i of y are a "
            "positive pair; every other row of y is a negative for row i of x)."
        )
    for arg, array in (("x", x), ("y", y)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise TypeError(
                f"{name}: {arg} has dtype {array.dtype}; pass floating-point "
                f"embeddings (e.g. {arg}.astype(jnp.float32))."
            )
    return x, y


def _checked_scalar(name: str, arg: str, value: ArrayLike, x: Array, y: Array) -> Array:
    """A real scalar; an int (which has no gradient) in the loss's float dtype."""
    value = jnp.asarray(value)
    integer = jnp.issubdtype(value.dtype, jnp.integer)
    if value.shape != () or not (integer or jnp.issubdtype(value.dtype, jnp.floating)):
        raise ValueError(
            f"{name}: {arg} has shape {value.shape} and dtype {value.dtype}; it "
            f"must be a real scalar, an int or a float (e.g. jnp.squeeze({arg}))."
        )
    return value.astype(_contrastive.accum_dtype(x, y)) if integer else value


def _checked_block_size(name: str, block_size: int, batch: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{name}: block_size must be an int, got {block_size!r}.")
    if block_size < 1:
        raise ValueError(f"{name}: block_size must be >= 1, got {block_size}.")
    return min(block_size, batch)  # one block of B rows holds the whole batch


def softmax_contrastive(
    x: ArrayLike,
    y: ArrayLike,
    logit_scale: ArrayLike,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Array:
    r"""CLIP's symmetric InfoNCE loss, without the B x B logits.

    With logits \(s = \text{logit\_scale} \cdot x y^\top\) (B x B), the loss
    is the mean of the two cross-entropies that take row i of ``x`` and row i
    of ``y`` as the positive pair, one over each row of \(s\) (``x`` to
    ``y``) and one over each column (``y`` to ``x``):

    \[
    \frac{1}{2B} \sum_{i=1}^{B} \Big( \log \sum_j e^{s_{ij}}
      + \log \sum_j e^{s_{ji}} - 2 s_{ii} \Big),
    \]

    ``(CE(s, arange(B)) + CE(s.T, arange(B))) / 2``, each CE a mean over the
    batch: open_clip's ``ClipLoss`` on one device. The rows' log-sum-exps are
    taken a block at a time, the columns' with a running max and sum across
    blocks, and the backward recomputes each block's logits: memory
    O(B·D + block_size·B). Each row's and column's term, its log-sum-exp
    less its positive's logit, is formed before the sum, so the value is a
    sum of non-negative terms; it and the scale's gradient are no further
    from float64 than the formula in float32. Differentiable in ``x``, ``y``
    and ``logit_scale`` in reverse mode (a ``jax.custom_vjp``: ``jax.grad``,
    not ``jax.jvp``); it jits and vmaps.

    Args:
      x: ``(B, D)`` embeddings of one modality (images), floating point. Not
        normalised here: divide rows by their norm first if the model does.
      y: ``(B, D)`` embeddings of the other (texts); row i pairs with row i of
        ``x``.
      logit_scale: the multiplier of the similarities, a real scalar (CLIP
        learns its log and passes ``jnp.exp(log_scale)``, as to open_clip's
        loss); an int is taken in the loss's float dtype.
      block_size: rows of ``x`` scored against all of ``y`` at once; any
        value >= 1 (B need not be a multiple: the last block is masked; a
        block_size >= B is one block).

    Returns:
      The loss, a scalar in float32 (float64 for float64 inputs).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum
      >>> x = jnp.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
      >>> y = jnp.array([[0.8, 0.6], [0.0, 1.0], [-0.6, 0.8]])
      >>> loss = jaxaccum.losses.softmax_contrastive(x, y, 10.0, block_size=2)
      >>> logits = 10.0 * x @ y.T
      >>> labels = jnp.arange(3)
      >>> ce = optax.softmax_cross_entropy_with_integer_labels
      >>> formula = (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2
      >>> print(f"{loss:.5f} {formula:.5f}")
      1.31116 1.31116

    References:
      Radford et al. 2021, "Learning Transferable Visual Models From Natural
      Language Supervision" (CLIP).
    """
    name = "softmax_contrastive"
    x, y = _checked_pair(name, x, y)
    scale = _checked_scalar(name, "logit_scale", logit_scale, x, y)
    block_size = _checked_block_size(name, block_size, x.shape[0])
    return _contrastive.softmax_contrastive(x, y, scale, block_size)


def sigmoid_contrastive(
    x: ArrayLike,
    y: ArrayLike,
    logit_scale: ArrayLike,
    logit_bias: ArrayLike,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Array:
    r"""SigLIP's pairwise sigmoid loss, without the B x B logits.

    With logits \(s = \text{logit\_scale} \cdot x y^\top + \text{logit\_bias}\)
    and labels \(z_{ij} = 1\) where \(i = j\), \(-1\) elsewhere, every pair is
    its own binary classification:

    \[
    -\frac{1}{B} \sum_{i=1}^{B} \sum_{j=1}^{B} \log \sigma(z_{ij} s_{ij}),
    \]

    the sum over all \(B^2\) pairs divided by \(B\) (SigLIP's normalisation, as in its
    paper's pseudo-code and open_clip's ``SigLipLoss``; not a mean over the
    pairs). Computed a block of rows at a time, the backward recomputing each
    block's logits: memory O(B·D + block_size·B). Differentiable in ``x``,
    ``y``, ``logit_scale`` and ``logit_bias`` in reverse mode (a
    ``jax.custom_vjp``: ``jax.grad``, not ``jax.jvp``).

    Args:
      x: ``(B, D)`` embeddings of one modality, floating point; not normalised
        here.
      y: ``(B, D)`` embeddings of the other; row i pairs with row i of ``x``.
      logit_scale: the multiplier, a real scalar (SigLIP learns its log,
        starting at ``log(10)``, and passes ``jnp.exp(log_scale)``).
      logit_bias: added to every logit, a real scalar (SigLIP starts it at
        -10). An int scale or bias is taken in the loss's float dtype.
      block_size: rows of ``x`` scored against all of ``y`` at once; any
        value >= 1 (the last block is masked where B is not a multiple).

    Returns:
      The loss, a scalar in float32 (float64 for float64 inputs).

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> x = jnp.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
      >>> y = jnp.array([[0.8, 0.6], [0.0, 1.0], [-0.6, 0.8]])
      >>> loss = jaxaccum.losses.sigmoid_contrastive(x, y, 10.0, -5.0, block_size=2)
      >>> logits = 10.0 * x @ y.T - 5.0
      >>> labels = 2 * jnp.eye(3) - 1
      >>> formula = -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / 3
      >>> print(f"{loss:.5f} {formula:.5f}")
      3.72919 3.72919

    References:
      Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training"
      (SigLIP).
    """
    name = "sigmoid_contrastive"
    x, y = _checked_pair(name, x, y)
    scale = _checked_scalar(name, "logit_scale", logit_scale, x, y)
    bias = _checked_scalar(name, "logit_bias", logit_bias, x, y)
    block_size = _checked_block_size(name, block_size, x.shape[0])
    return _contrastive.sigmoid_contrastive(x, y, scale, bias, block_size)
