"""aux_reduction="concat": per-example aux back in the batch's own order.

Tolerances (float32): logits agree with the full batch's to RTOL, ATOL
(tests/tolerances.py); the accuracy, a count over identical argmaxes, exactly.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from tolerances import ATOL, RTOL

import jaxaccum

# Float32 rounding bounds, derived in tests/tolerances.py.


class CNN(nn.Module):
    """The Flax MNIST example's model, smaller."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=8, kernel_size=(3, 3))(x))
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=32)(x))
        return nn.Dense(features=10)(x)


def _state_and_batch(batch_size: int):
    model = CNN()
    images = jax.random.normal(jax.random.key(0), (batch_size, 8, 8, 1))
    labels = jax.random.randint(jax.random.key(1), (batch_size,), 0, 10)
    params = model.init(jax.random.key(2), images[:1])["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1)
    )
    return state, images, labels


def make_apply_model(value_and_grad):
    """The Flax MNIST example's ``apply_model``, its images and labels passed
    to the loss instead of closed over; ``value_and_grad`` is the only change."""

    def apply_model(state, images, labels):
        def loss_fn(params, images, labels):
            logits = state.apply_fn({"params": params}, images)
            one_hot = jax.nn.one_hot(labels, 10)
            loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
            return loss, logits

        grad_fn = value_and_grad(loss_fn)
        (loss, logits), grads = grad_fn(state.params, images, labels)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return grads, loss, accuracy, logits

    return apply_model


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 8])
def test_flax_mnist_apply_model_ported_unchanged(num_microbatches):
    state, images, labels = _state_and_batch(32)
    full = jax.jit(make_apply_model(lambda f: jax.value_and_grad(f, has_aux=True)))
    accumulated = jax.jit(
        make_apply_model(
            lambda f: jaxaccum.value_and_grad(
                f,
                num_microbatches,
                batch_argnums=(1, 2),
                has_aux=True,
                aux_reduction="concat",
            )
        )
    )
    grads, loss, accuracy, logits = accumulated(state, images, labels)
    want_grads, want_loss, want_accuracy, want_logits = full(state, images, labels)
    assert logits.shape == (32, 10)
    np.testing.assert_allclose(logits, want_logits, rtol=RTOL, atol=ATOL)
    assert float(accuracy) == float(want_accuracy), (accuracy, want_accuracy)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
        grads,
        want_grads,
    )


def test_concat_with_pad_drops_the_padded_rows():
    def loss(w, x, example_mask):
        per_example = x @ w
        return jaxaccum.masked_sum(per_example**2, example_mask), per_example

    w, x = jnp.arange(3.0), jax.random.normal(jax.random.key(0), (10, 3))
    (_, per_example), _ = jaxaccum.value_and_grad(
        loss,
        4,  # 10 rows pad to 12: micro-batches of 3, the last rows padded
        reduction="weighted",
        pad=True,
        has_aux=True,
        aux_reduction="concat",
    )(w, x)
    np.testing.assert_allclose(per_example, x @ w, rtol=RTOL, atol=ATOL)


def test_concat_and_stack_side_by_side():
    def loss(w, x):
        return jnp.mean(x @ w), {"rows": x[:, 0], "firsts": x[0, 0]}

    x = jnp.arange(24.0).reshape(8, 3)
    (_, aux), _ = jaxaccum.value_and_grad(
        loss, 4, has_aux=True, aux_reduction={"rows": "concat", "firsts": "stack"}
    )(jnp.ones(3), x)
    np.testing.assert_array_equal(aux["rows"], x[:, 0])  # batch order
    np.testing.assert_array_equal(aux["firsts"], x[:4, 0])  # micro-batch k: row k


def test_concat_of_a_leaf_without_a_per_example_axis_is_named():
    def loss(w, x):
        return jnp.mean(x @ w), {"scalar": jnp.sum(x)}

    step = jaxaccum.value_and_grad(loss, 2, has_aux=True, aux_reduction="concat")
    with pytest.raises(ValueError, match=r"aux leaf \['scalar'\] of shape \(\)"):
        step(jnp.ones(3), jnp.ones((8, 3)))


def test_pad_with_a_fun_that_takes_no_example_mask_says_to_add_it():
    def loss(w, x):
        return jnp.sum(x @ w), x.shape[0]

    with pytest.raises(TypeError, match="Add `example_mask` to its signature"):
        jaxaccum.value_and_grad(loss, 4, reduction="weighted", pad=True)
