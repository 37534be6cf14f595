"""Exact token-weighted accumulation: masked losses, ragged windows, zero weight.

Tolerances (float32): RTOL, ATOL (tests/tolerances.py) against the full-batch
masked mean.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import next_token_losses, token_batch
from tolerances import ATOL, RTOL

import jaxaccum
from jaxaccum.cli.models import Transformer
from jaxaccum.testing import assert_grads_match_full_batch, leaf_errors

# Float32 rounding bounds, derived in tests/tolerances.py.
MODEL = Transformer(vocab=11, width=16, layers=1, heads=2)  # causal LM
# Even examples hold 2 tokens, odd ones 12: with the strided split, micro-batch
# 0 (even examples) is mostly padding for every N in {2, 4, 8}.
LENGTHS = [2 if i % 2 == 0 else 12 for i in range(16)]


@pytest.fixture(scope="module")
def lm():
    batch = token_batch(jax.random.key(0), LENGTHS)
    params = MODEL.init(jax.random.key(1), batch["tokens"][:1, :-1])["params"]
    return params, batch


def weighted_loss(params, batch):
    return jaxaccum.masked_sum(*next_token_losses(MODEL, params, batch))


def per_microbatch_mean(params, batch):
    """The classic bug: each micro-batch's own token mean, then averaged."""
    loss_sum, count = weighted_loss(params, batch)
    return loss_sum / count


def full_batch_masked_mean(params, batch):
    losses, mask = next_token_losses(MODEL, params, batch)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.sum(mask)


@pytest.mark.parametrize("num_microbatches", [2, 4, 8])
def test_weighted_matches_full_batch_and_mean_of_means_does_not(lm, num_microbatches):
    params, batch = lm
    expected = jax.jit(jax.value_and_grad(full_batch_masked_mean))(params, batch)
    weighted = jax.jit(
        jaxaccum.value_and_grad(weighted_loss, num_microbatches, reduction="weighted")
    )(params, batch)
    chex.assert_trees_all_close(weighted, expected, rtol=RTOL, atol=ATOL)

    naive = jax.jit(jaxaccum.value_and_grad(per_microbatch_mean, num_microbatches))(
        params, batch
    )
    weighted_error = max(e[1] for e in leaf_errors(weighted, expected))
    naive_error = max(e[1] for e in leaf_errors(naive, expected))
    # The bug is large: the mean of means overweights the padding-heavy
    # micro-batch's few tokens.
    assert naive_error > 1e-3, naive_error
    assert naive_error > 1000 * weighted_error, (naive_error, weighted_error)


def test_assertion_supports_weighted(lm):
    params, batch = lm
    assert_grads_match_full_batch(
        weighted_loss,
        params,
        batch,
        num_microbatches=4,
        reduction="weighted",
        rtol=RTOL,
        atol=ATOL,
    )
    with pytest.raises(AssertionError, match="num_microbatches=4"):
        assert_grads_match_full_batch(
            per_microbatch_mean,
            params,
            batch,
            num_microbatches=4,
            rtol=RTOL,
            atol=ATOL,
        )


def test_weighted_with_aux(lm):
    params, batch = lm

    def fun(params, batch):
        loss_sum, count = weighted_loss(params, batch)
        return (loss_sum, count), {"tokens": count}

    (value, aux), grads = jax.jit(
        jaxaccum.value_and_grad(
            fun, 4, reduction="weighted", has_aux=True, aux_reduction="sum"
        )
    )(params, batch)
    expected = jax.jit(jax.value_and_grad(full_batch_masked_mean))(params, batch)
    chex.assert_trees_all_close((value, grads), expected, rtol=RTOL, atol=ATOL)
    assert float(aux["tokens"]) == sum(length - 1 for length in LENGTHS)


def test_ragged_batch_with_padding_matches_unpadded_full_batch():
    batch = token_batch(jax.random.key(2), [3 + i % 9 for i in range(30)])
    params = MODEL.init(jax.random.key(1), batch["tokens"][:1, :-1])["params"]

    def masked(params, batch, *, example_mask):
        losses, mask = next_token_losses(MODEL, params, batch)
        return jaxaccum.masked_sum(losses, mask & example_mask[:, None])

    expected = jax.jit(jax.value_and_grad(full_batch_masked_mean))(params, batch)
    masks_seen = []

    def recording(params, batch, *, example_mask):
        masks_seen.append(example_mask.shape)
        return masked(params, batch, example_mask=example_mask)

    actual = jax.jit(
        jaxaccum.value_and_grad(recording, 4, reduction="weighted", pad=True)
    )(params, batch)
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    assert masks_seen[-1] == (8,)  # 30 rows padded to 32: 4 micro-batches of 8
    by_size = jax.jit(
        jaxaccum.value_and_grad(
            masked, microbatch_size=8, reduction="weighted", pad=True
        )
    )(params, batch)
    chex.assert_trees_all_close(by_size, expected, rtol=RTOL, atol=ATOL)
    assert_grads_match_full_batch(
        masked,
        params,
        batch,
        num_microbatches=4,
        reduction="weighted",
        pad=True,
        rtol=RTOL,
        atol=ATOL,
    )


def test_padding_needs_opt_in_and_a_maskable_reduction():
    params, batch = jnp.ones(3), jnp.ones((30, 3))

    def loss(w, x):
        return jnp.mean(x @ w)

    with pytest.raises(ValueError, match="not divisible by num_microbatches=4"):
        jaxaccum.value_and_grad(loss, 4)(params, batch)
    with pytest.raises(ValueError, match="pad=True needs reduction='weighted'"):
        jaxaccum.value_and_grad(loss, 4, pad=True)


def test_padded_sum_reduction():
    w, x = jnp.arange(3.0), jnp.arange(90.0).reshape(30, 3)

    def loss(w, x, *, example_mask):
        return jnp.sum(jnp.where(example_mask, jnp.tanh(x @ w / 100), 0.0))

    actual = jaxaccum.value_and_grad(loss, 4, reduction="sum", pad=True)(w, x)
    expected = jax.value_and_grad(lambda w, x: jnp.sum(jnp.tanh(x @ w / 100)))(w, x)
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_zero_weight_window_gives_zero_finite_gradients(lm, num_microbatches):
    params, batch = lm
    empty = dict(batch, lengths=jnp.ones_like(batch["lengths"]))  # no targets
    value, grads = jax.jit(
        jaxaccum.value_and_grad(weighted_loss, num_microbatches, reduction="weighted")
    )(params, empty)
    chex.assert_tree_all_finite((value, grads))
    assert float(value) == 0.0
    for leaf in jax.tree.leaves(grads):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_weighted_output_must_be_a_pair_of_scalars(lm):
    params, batch = lm
    with pytest.raises(TypeError, match=r"must return \(loss_sum, weight\)"):
        jaxaccum.value_and_grad(per_microbatch_mean, 2, reduction="weighted")(
            params, batch
        )

    def vector_weight(params, batch):
        losses, mask = next_token_losses(MODEL, params, batch)
        return jnp.sum(losses * mask), jnp.sum(mask, axis=1)

    with pytest.raises(TypeError, match="weight fun returns must be a scalar"):
        jaxaccum.value_and_grad(vector_weight, 2, reduction="weighted")(params, batch)


def test_masked_sum_ignores_nan_at_masked_positions():
    losses = jnp.array([1.0, jnp.nan, jnp.inf, 2.0])
    mask = jnp.array([True, False, False, True])
    total, count = jaxaccum.masked_sum(losses, mask)
    assert (float(total), float(count)) == (3.0, 2.0)
    weights = jnp.array([0.5, 0.0, 0.0, 2.0])
    total, weight = jaxaccum.masked_sum(losses, weights)
    assert (float(total), float(weight)) == (4.5, 2.5)
    grad = jax.grad(lambda x: jaxaccum.masked_sum(x, mask)[0])(losses)
    np.testing.assert_array_equal(grad, [1.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("accum_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("count_dtype", [jnp.int32, jnp.float32])
def test_counts_sum_in_at_least_float32_whatever_accum_dtype(accum_dtype, count_dtype):
    """Token counts (~10k a row, 160k a window) summed in float16 overflowed
    (value and gradients read exactly 0), in bfloat16 rounded the value by
    0.25%; an int32 aux summed through a float lost its low bits. Counts sum
    in at least float32 (integers exactly), the value too; the float32
    parameters' gradients accumulate in float32 ("at least"): RTOL holds."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((8, 2)) / np.sqrt(8), jnp.float32)
    batch = {
        "x": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((16, 2)), jnp.float32),
        "count": jnp.asarray(rng.integers(9_000, 11_000, 16), count_dtype),
        "big": jnp.full(16, 2**23 + 1, jnp.int32),
    }

    def loss(w, batch):
        rows = jnp.sum((batch["x"] @ w - batch["y"]) ** 2, -1)
        count = batch["count"]
        loss_sum = jnp.sum(count.astype(jnp.float32) * rows)
        return (loss_sum, jnp.sum(count)), {"big": jnp.sum(batch["big"])}

    step = jaxaccum.value_and_grad(
        loss,
        4,
        reduction="weighted",
        has_aux=True,
        aux_reduction="sum",
        accum_dtype=accum_dtype,
    )
    (value, aux), grads = jax.jit(step)(w, batch)

    def whole(w):
        (total, weight), aux = loss(w, batch)
        return total / weight, aux

    (expected, _), expected_grads = jax.value_and_grad(whole, has_aux=True)(w)
    chex.assert_trees_all_close(
        (value, grads), (expected, expected_grads), rtol=RTOL, atol=ATOL
    )
    assert aux["big"].dtype == jnp.int32 and int(aux["big"]) == 16 * (2**23 + 1)
