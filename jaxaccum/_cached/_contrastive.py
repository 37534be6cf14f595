"""The contrastive losses a block of rows at a time, with a recomputing backward.

Both losses score every row of ``x`` against every row of ``y``: a B x B
matrix of logits. Forward and backward scan over blocks of ``block_size`` rows
of ``x`` (against all of ``y``), so no more than ``block_size x B`` logits
exist at once; the backward (a ``jax.custom_vjp``) recomputes each block's
logits instead of saving them. What each saves for the backward is O(B): the
inputs and, for the softmax loss, one log-sum-exp per row and per column.

The rows past B in the last block are zeros, masked out of every sum. Logits
and sums are in ``accum`` (float32, or float64 for float64 inputs): a bfloat16
embedding's products are exact in float32, and its sums are taken there.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array


class _Blocks(NamedTuple):
    """The rows of ``x`` as ``(num_blocks, block_size, ...)`` scan inputs."""

    x: Array  # (num_blocks, block_size, D): rows past B are zeros
    valid: Array  # (num_blocks, block_size): whether a row is one of the B
    rows: Array  # (num_blocks, block_size): each row's index in x


def _blocks(x: Array, block_size: int) -> _Blocks:
    batch = x.shape[0]
    num_blocks = -(-batch // block_size)
    padded = jnp.pad(x, ((0, num_blocks * block_size - batch), (0, 0)))
    rows = jnp.arange(num_blocks * block_size).reshape(num_blocks, block_size)
    return _Blocks(padded.reshape(num_blocks, block_size, -1), rows < batch, rows)


def _unblock(blocks: Array, batch: int) -> Array:
    """``(num_blocks, block_size, ...)`` back to the B rows."""
    return blocks.reshape(-1, *blocks.shape[2:])[:batch]


def _diagonal(rows: Array, batch: int) -> Array:
    """``(block_size, B)``: whether a block's logit is a positive pair's."""
    return rows[:, None] == jnp.arange(batch)[None, :]


def accum_dtype(*arrays: Array) -> jnp.dtype:
    """Float32, or float64 where an input is float64."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _dot_rows(x_block: Array, y: Array, accum: jnp.dtype) -> Array:
    """``x_block @ y.T`` in ``accum``: one block of the raw similarities."""
    return jnp.dot(x_block, y.T, preferred_element_type=accum)


def _pull_back(
    grad_logits: Array, x_block: Array, y: Array, scale: Array
) -> tuple[Array, Array]:
    """A block's cotangents of ``x_block`` and ``y``, given the cotangent of
    its logits ``scale * x_block @ y.T (+ bias)``."""
    accum = grad_logits.dtype
    dx_block = scale * jnp.dot(grad_logits, y, preferred_element_type=accum)
    dy = scale * jnp.dot(grad_logits.T, x_block, preferred_element_type=accum)
    return dx_block, dy


def _zero(accum: jnp.dtype, *arrays: Array) -> Array:
    """A scalar 0 in ``accum`` typed as varying wherever any of ``arrays``
    is (under ``shard_map``, a scan's carry must start as its body leaves
    it: a constant start fails on a device's varying values)."""
    return sum(
        (jnp.zeros_like(a, dtype=accum, shape=()) for a in arrays),
        start=jnp.zeros((), accum),
    )


def _cotangent_of(primal: Array, cotangent: Array) -> Array:
    """``cotangent`` as ``primal``'s: its dtype, and under ``shard_map`` its
    type. An input the same on every device (a replicated temperature, an
    all-gathered ``y``) gets the sum of the devices' cotangents, as JAX's own
    transpose of the implicit ``pvary`` gives it; JAX refuses a varying one."""
    extra = set(jax.typeof(cotangent).manual_axis_type.varying) - set(
        jax.typeof(primal).manual_axis_type.varying
    )
    if extra:
        cotangent = jax.lax.psum(cotangent, tuple(sorted(extra)))
    return cotangent.astype(primal.dtype)


class _SoftmaxSaved(NamedTuple):
    x: Array
    y: Array
    scale: Array
    row_lse: Array  # (num_blocks, block_size): each row's log-sum-exp
    col_lse: Array  # (B,): each column's log-sum-exp


def _softmax_forward(
    x: Array, y: Array, scale: Array, block_size: int
) -> tuple[Array, _SoftmaxSaved]:
    accum = accum_dtype(x, y, scale)
    batch = x.shape[0]
    scale_accum = scale.astype(accum)
    blocks = _blocks(x, block_size)

    @jax.named_scope("softmax_contrastive_block")
    def body(carry, block):
        col_max, col_sum = carry
        x_block, valid, rows = block
        logits = scale_accum * _dot_rows(x_block, y, accum)
        # The positive is the block's own diagonal entry, the very number its
        # row's and column's max and sum saw: a row's or column's term,
        # (max - positive) + log(sum), is then >= 0, and exactly 0 where the
        # positive dominates.
        positive = jnp.sum(jnp.where(_diagonal(rows, batch), logits, 0), axis=1)
        row_max = jnp.max(logits, axis=1)
        row_log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=1))
        # The columns' log-sum-exp, online: a running max and a sum scaled to
        # it (block 0 always holds row 0, so the max is finite after it).
        masked = jnp.where(valid[:, None], logits, -jnp.inf)
        new_max = jnp.maximum(col_max, jnp.max(masked, axis=0))
        col_sum = col_sum * jnp.exp(col_max - new_max) + jnp.sum(
            jnp.exp(masked - new_max), axis=0
        )
        row_term = (row_max - positive) + row_log_sum
        return (new_max, col_sum), (row_max + row_log_sum, row_term, positive)

    zero = _zero(accum, x, y, scale)
    start = (jnp.full(batch, -jnp.inf, accum) + zero, jnp.zeros(batch, accum) + zero)
    (col_max, col_sum), (row_lse, row_term, positive) = jax.lax.scan(
        body, start, tuple(blocks)
    )
    col_term = (col_max - _unblock(positive, batch)) + jnp.log(col_sum)
    # A sum of non-negative terms: the value is as close to float64 as the
    # formula's (a difference of sums that grow with B x scale was not).
    total = jnp.sum(jnp.where(blocks.valid, row_term, 0)) + jnp.sum(col_term)
    loss = total / (2 * batch)
    return loss, _SoftmaxSaved(x, y, scale, row_lse, col_lse=col_max + jnp.log(col_sum))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def softmax_contrastive(x: Array, y: Array, scale: Array, block_size: int) -> Array:
    """CLIP's symmetric InfoNCE, blockwise (jaxaccum.losses documents it)."""
    return _softmax_forward(x, y, scale, block_size)[0]


def _softmax_backward(
    block_size: int, saved: _SoftmaxSaved, cotangent: Array
) -> tuple[Array, Array, Array]:
    x, y, scale, row_lse, col_lse = saved
    accum, batch = row_lse.dtype, x.shape[0]
    scale_accum = scale.astype(accum)
    # d loss / d logits = (softmax over the row + softmax over the column
    # - 2 on the diagonal) / 2B. The scan takes the off-diagonal entries; a
    # diagonal one is minus its row's and column's off-diagonal probabilities,
    # which near convergence are tiny where 1 - p_ii would lose them.
    weight = cotangent.astype(accum) / (2 * batch)
    raw_positive = jnp.sum(x.astype(accum) * y.astype(accum), axis=1)
    blocks = _blocks(x, block_size)

    @jax.named_scope("softmax_contrastive_block_vjp")
    def body(carry, block):
        dy, dscale, col_off = carry
        x_block, valid, rows, row_lse_block = block
        raw = _dot_rows(x_block, y, accum)
        logits = scale_accum * raw
        off = valid[:, None] & ~_diagonal(rows, batch)
        row_probs = jnp.where(off, jnp.exp(logits - row_lse_block[:, None]), 0)
        col_probs = jnp.where(off, jnp.exp(logits - col_lse[None, :]), 0)
        dx_block, dy_block = _pull_back(
            weight * (row_probs + col_probs), x_block, y, scale_accum
        )
        # d loss / d scale, each probability times its logit's distance from
        # the positive's before the sum (a sum less 2 x the positives cancels).
        row_positive = jnp.take(raw_positive, rows, mode="clip")[:, None]
        dscale_block = jnp.sum(
            row_probs * (raw - row_positive) + col_probs * (raw - raw_positive)
        )
        carry = (dy + dy_block, dscale + dscale_block, col_off + col_probs.sum(0))
        return carry, (dx_block, row_probs.sum(1))

    zero = _zero(accum, x, y, scale, row_lse, col_lse, cotangent)
    start = (jnp.zeros(y.shape, accum) + zero, zero, jnp.zeros(batch, accum) + zero)
    (dy, dscale, col_off), (dx_blocks, row_off) = jax.lax.scan(
        body, start, (*blocks, row_lse)
    )
    diagonal = -weight * scale_accum * (_unblock(row_off, batch) + col_off)
    dx = _unblock(dx_blocks, batch) + diagonal[:, None] * y.astype(accum)
    dy = dy + diagonal[:, None] * x.astype(accum)
    return (
        _cotangent_of(x, dx),
        _cotangent_of(y, dy),
        _cotangent_of(scale, weight * dscale),
    )


def _softmax_fwd(x, y, scale, block_size):
    return _softmax_forward(x, y, scale, block_size)


softmax_contrastive.defvjp(_softmax_fwd, _softmax_backward)


def _sigmoid_block(
    x_block: Array, rows: Array, y: Array, scale: Array, bias: Array
) -> tuple[Array, Array, Array]:
    """A block's raw similarities, logits and labels (+1 on the diagonal)."""
    raw = _dot_rows(x_block, y, scale.dtype)
    labels = jnp.where(_diagonal(rows, y.shape[0]), 1, -1)
    return raw, scale * raw + bias, labels.astype(raw.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def sigmoid_contrastive(
    x: Array, y: Array, scale: Array, bias: Array, block_size: int
) -> Array:
    """SigLIP's pairwise sigmoid loss, blockwise (jaxaccum.losses documents it)."""
    accum = accum_dtype(x, y, scale, bias)
    scale_accum, bias_accum = scale.astype(accum), bias.astype(accum)
    blocks = _blocks(x, block_size)

    @jax.named_scope("sigmoid_contrastive_block")
    def body(total, block):
        x_block, valid, rows = block
        _, logits, labels = _sigmoid_block(x_block, rows, y, scale_accum, bias_accum)
        terms = -jax.nn.log_sigmoid(labels * logits)
        return total + jnp.sum(jnp.where(valid[:, None], terms, 0)), None

    total, _ = jax.lax.scan(body, _zero(accum, x, y, scale, bias), tuple(blocks))
    return total / x.shape[0]


def _sigmoid_fwd(x, y, scale, bias, block_size):
    return sigmoid_contrastive(x, y, scale, bias, block_size), (x, y, scale, bias)


def _sigmoid_backward(
    block_size: int, saved: tuple[Array, Array, Array, Array], cotangent: Array
) -> tuple[Array, Array, Array, Array]:
    x, y, scale, bias = saved
    accum, batch = accum_dtype(x, y, scale, bias), x.shape[0]
    scale_accum, bias_accum = scale.astype(accum), bias.astype(accum)
    weight = cotangent.astype(accum) / batch
    blocks = _blocks(x, block_size)

    @jax.named_scope("sigmoid_contrastive_block_vjp")
    def body(carry, block):
        dy, dscale, dbias = carry
        x_block, valid, rows = block
        raw, logits, labels = _sigmoid_block(x_block, rows, y, scale_accum, bias_accum)
        # d/dl of -log_sigmoid(z l) is -z sigmoid(-z l).
        grad_logits = -weight * labels * jax.nn.sigmoid(-labels * logits)
        grad_logits = jnp.where(valid[:, None], grad_logits, 0)
        dx_block, dy_block = _pull_back(grad_logits, x_block, y, scale_accum)
        dscale_block = jnp.sum(grad_logits * raw)
        carry = (dy + dy_block, dscale + dscale_block, dbias + jnp.sum(grad_logits))
        return carry, dx_block

    zero = _zero(accum, x, y, scale, bias, cotangent)
    start = (jnp.zeros(y.shape, accum) + zero, zero, zero)
    (dy, dscale, dbias), dx_blocks = jax.lax.scan(body, start, tuple(blocks))
    return (
        _cotangent_of(x, _unblock(dx_blocks, batch)),
        _cotangent_of(y, dy),
        _cotangent_of(scale, dscale),
        _cotangent_of(bias, dbias),
    )


sigmoid_contrastive.defvjp(_sigmoid_fwd, _sigmoid_backward)
