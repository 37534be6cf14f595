"""cached_value_and_grad's random state: keys in key_argnums are split per
micro-batch as value_and_grad splits them and replayed in pass 2, bit for
bit where XLA compiles at its default level; per-example keys carried in the
batch give the big batch's dropout at any N. Tolerances as
tests/test_cached.py's (float32 within 1e-5 normwise, the same sums in
another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cached_models import (
    BATCH,
    EMBED,
    assert_normwise_close,
    big_batch,
    towers,
)
from xla_level import compiled_at_lowest_level

import jaxaccum

FLOAT32_NORMWISE_TOL = 1e-5


def dropout_encode(params, batch, key):
    """The image tower with dropout drawn from the micro-batch's key."""
    first, second = params["image"]
    hidden = jnp.tanh(batch["image"] @ first)
    keep = jax.random.bernoulli(key, 0.6, hidden.shape)
    return {"image": (jnp.where(keep, hidden, 0.0) / 0.6) @ second}


def self_similarity_loss(params, outputs, key):
    del key
    image = outputs["image"]
    logits = jnp.exp(params["log_scale"]) * image @ image.T / EMBED
    labels = jnp.arange(image.shape[0])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_key_argnums_replays_pass_one_bitwise_in_pass_two():
    """Each micro-batch's forward in pass 2 is pass 1's, bit for bit, and
    draws the key value_and_grad's split gives it."""
    num = 4
    params, batch = towers()
    key = jax.random.key(7)
    seen: dict[bytes, list[np.ndarray]] = {}

    def recording_encode(params, batch, key):
        outputs = dropout_encode(params, batch, key)

        def record(images, embedded):
            seen.setdefault(np.asarray(images).tobytes(), []).append(
                np.asarray(embedded)
            )

        jax.debug.callback(record, batch["image"], outputs["image"])
        return outputs

    step = jaxaccum.cached_value_and_grad(
        recording_encode, self_similarity_loss, num, key_argnums=2
    )
    got = jax.block_until_ready(jax.jit(step)(params, batch, key))
    micro_batches = jaxaccum.split_batch(batch, num)
    micro_keys = jax.random.split(key, num)
    assert len(seen) == num, len(seen)
    for index in range(num):
        micro = jax.tree.map(lambda x, i=index: x[i], micro_batches)
        first_pass, second_pass = seen[np.asarray(micro["image"]).tobytes()]
        direct = dropout_encode(params, micro, micro_keys[index])["image"]
        for other in (second_pass, direct):
            if compiled_at_lowest_level():
                # The same masks (another key moves entries by O(1)), the
                # same sums in other machine code.
                assert_normwise_close(first_pass, other, FLOAT32_NORMWISE_TOL)
            else:
                np.testing.assert_array_equal(first_pass, other)

    # The gradient of the big batch with those masks.
    def composed(params, micro_keys):
        outputs = [
            dropout_encode(
                params,
                jax.tree.map(lambda x, i=i: x[i], micro_batches),
                micro_keys[i],
            )
            for i in range(num)
        ]
        image = jnp.stack([o["image"] for o in outputs], 1).reshape(BATCH, EMBED)
        return self_similarity_loss(params, {"image": image}, key)

    want = jax.jit(jax.value_and_grad(composed))(params, micro_keys)
    assert_normwise_close(
        (got[0], got[1]["image"], got[1]["log_scale"]),
        (want[0], want[1]["image"], want[1]["log_scale"]),
        FLOAT32_NORMWISE_TOL,
    )


def test_key_argnums_at_one_microbatch_is_the_big_batch():
    params, batch = towers()
    key = jax.random.key(3)
    step = jaxaccum.cached_value_and_grad(
        dropout_encode, self_similarity_loss, 1, key_argnums=2
    )
    got = jax.jit(step)(params, batch, key)
    want = big_batch(dropout_encode, self_similarity_loss)(params, batch, key)
    assert_normwise_close(
        (got[0], got[1]["image"]), (want[0], want[1]["image"]), FLOAT32_NORMWISE_TOL
    )


@pytest.mark.parametrize("num_microbatches", [2, 8])
def test_per_example_keys_give_the_big_batch_dropout_at_any_n(num_microbatches):
    def keyed_encode(params, batch):
        first, second = params["image"]
        hidden = jnp.tanh(batch["image"] @ first)
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.6, hidden.shape[1:]))(
            batch["key"]
        )
        return {"image": (jnp.where(keep, hidden, 0.0) / 0.6) @ second}

    def loss(params, outputs):
        return self_similarity_loss(params, outputs, None)

    params, batch = towers()
    batch = {"image": batch["image"], "key": jax.random.split(jax.random.key(5), BATCH)}
    step = jaxaccum.cached_value_and_grad(keyed_encode, loss, num_microbatches)
    got = jax.jit(step)(params, batch)
    want = big_batch(keyed_encode, loss)(params, batch)
    assert_normwise_close(
        (got[0], got[1]["image"], got[1]["log_scale"]),
        (want[0], want[1]["image"], want[1]["log_scale"]),
        FLOAT32_NORMWISE_TOL,
    )
