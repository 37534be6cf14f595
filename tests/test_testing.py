"""jaxaccum.testing: the equivalence assertion passes and fails as it should."""

import jax
import jax.numpy as jnp
import pytest
from models import classification_batch, mlp_loss, mlp_params
from tolerances import ATOL, RTOL

from jaxaccum.testing import assert_grads_match_full_batch


def test_passes_on_a_correct_mean_loss():
    params, batch = (
        mlp_params(jax.random.key(0)),
        classification_batch(jax.random.key(1), 16),
    )
    assert_grads_match_full_batch(
        mlp_loss, params, batch, num_microbatches=4, rtol=RTOL, atol=ATOL
    )
    assert_grads_match_full_batch(
        mlp_loss, params, batch, microbatch_size=4, rtol=RTOL, atol=ATOL
    )


def test_failure_names_leaf_error_and_n():
    """A loss that scales with its batch size breaks exactness: it is caught."""
    params = {"w": jnp.ones(3)}
    batch = jax.random.normal(jax.random.key(0), (8, 3))

    def size_dependent(params, x):
        return jnp.sum(x @ params["w"]) / jnp.sqrt(x.shape[0])

    with pytest.raises(AssertionError) as info:
        assert_grads_match_full_batch(size_dependent, params, batch, num_microbatches=4)
    message = str(info.value)
    assert "num_microbatches=4" in message
    assert "['grads']['w']: max abs error" in message
    assert "relative error 0.5" in message  # sqrt(8)/sqrt(2) / sqrt(8) = 0.5 off
    assert "['value']" in message


def test_failure_with_microbatch_size_and_aux():
    def summed(params, x):
        return jnp.sum(x @ params), {"n": x.shape[0]}

    with pytest.raises(AssertionError, match="microbatch_size=2"):
        assert_grads_match_full_batch(
            summed, jnp.ones(3), jnp.ones((8, 3)), microbatch_size=2, has_aux=True
        )


def test_accepts_report_finite_and_state():
    def loss(w, x, state):
        return jnp.mean(jnp.tanh(x @ w)), state + 1

    assert_grads_match_full_batch(
        loss,
        jnp.ones(3),
        jnp.ones((8, 3)),
        jnp.zeros(()),
        num_microbatches=4,
        state_argnums=2,
        report_finite=True,
        rtol=RTOL,
        atol=ATOL,
    )
