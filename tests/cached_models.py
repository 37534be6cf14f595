"""The models of cached_value_and_grad's tests (tests/test_cached*.py): two
towers, a CLIP loss with a learnable temperature, labels and hard negatives,
and the contract they are held to, ``jax.value_and_grad`` of the loss on the
encoded big batch (compiled once per function and options)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

BATCH = 16
FEATURES = 6
EMBED = 4

FLOAT64_TOL = 1e-12
FLOAT32_NORMWISE_TOL = 1e-5


@contextlib.contextmanager
def float64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def towers(dtype=jnp.float32, seed=0):
    """Two towers' parameters and a batch: images, texts, hard negatives, labels."""
    keys = jax.random.split(jax.random.key(seed), 8)

    def dense(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out), dtype) / float(np.sqrt(fan_in))

    params = {
        "image": (dense(keys[0], FEATURES, 8), dense(keys[1], 8, EMBED)),
        "text": (dense(keys[2], FEATURES, 8), dense(keys[3], 8, EMBED)),
        "log_scale": jnp.asarray(np.log(4.0), dtype),  # CLIP's learnable temperature
    }
    batch = {
        "image": jax.random.normal(keys[4], (BATCH, FEATURES), dtype),
        "text": jax.random.normal(keys[5], (BATCH, FEATURES), dtype),
        "hard": jax.random.normal(keys[6], (BATCH, FEATURES), dtype),
        "label": jax.random.randint(keys[7], (BATCH,), 0, 5),
    }
    return params, batch


def tower(weights, x):
    first, second = weights
    return jnp.tanh(x @ first) @ second


def encode(params, batch):
    """Per-example outputs: both embeddings, a hard negative's, the label."""
    return {
        "image": tower(params["image"], batch["image"]),
        "text": tower(params["text"], batch["text"]),
        "hard": tower(params["text"], batch["hard"]),
        "label": batch["label"],
    }


def normalized(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def clip_loss(params, outputs):
    """CLIP's symmetric InfoNCE with a learnable temperature, each image's
    texts extended by the batch's hard negatives, the examples of one label
    positives of each other."""
    image, text = normalized(outputs["image"]), normalized(outputs["text"])
    hard = normalized(outputs["hard"])
    scale = jnp.exp(params["log_scale"])
    logits = scale * image @ jnp.concatenate([text, hard]).T
    label = outputs["label"]
    positive = label[:, None] == label[None, :]
    image_to_text = jax.nn.logsumexp(
        jnp.where(positive, logits[:, :BATCH], -jnp.inf), axis=1
    ) - jax.nn.logsumexp(logits, axis=1)
    text_to_image = jnp.diagonal(jax.nn.log_softmax(logits[:, :BATCH].T, axis=1))
    return -(jnp.mean(image_to_text) + jnp.mean(text_to_image)) / 2


@functools.cache
def big_batch(encode_fn, loss_fn, argnums=0, has_aux=False):
    """The contract: jax.value_and_grad of the loss on the encoded batch,
    one jitted function per (encode, loss, options), so that the tests that
    share them compile them once per dtype."""
    return jax.jit(
        jax.value_and_grad(
            lambda p, b, *a: loss_fn(p, encode_fn(p, b, *a), *a),
            argnums=argnums,
            has_aux=has_aux,
        )
    )


def relative_errors(got, want):
    """Each leaf's (and the value's) normwise relative error."""
    return jax.tree.map(
        lambda g, w: float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)), got, want
    )


def assert_normwise_close(got, want, tol):
    errors = relative_errors(got, want)
    worst = max(jax.tree.leaves(errors))
    assert worst <= tol, f"normwise relative errors {errors} above {tol}"
