"""Float64 windows of every front end equal the big batch to float64 rounding.

A micro-batch is differentiated at its share of the window (``1 / N`` for a
mean, ``1 / (N w_k)`` for a weighted loss). Where ``N`` is not a power of two
the share is not a binary fraction, so a share rounded to float32 moved every
float64 gradient by about 3e-8 relative; the share is taken in the loss's
dtype. Tolerances: RTOL64, ATOL64 (tests/tolerances.py), float64 rounding of
the tests' sums in two orders.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tolerances import ATOL64, RTOL64

import jaxaccum
import jaxaccum.equinox
import jaxaccum.flax

FEATURES = 3
# Window sizes whose 1 / N is not a binary fraction.
NOT_POWERS_OF_TWO = (3, 5, 6, 7, 12)


def per_example(w, batch):
    """Per-example losses of a small nonlinear model, and their weights."""
    return jnp.tanh(batch["x"] @ w["a"]) * w["b"] - batch["y"], batch["weight"]


def loss_of(reduction):
    """A loss of ``(w, batch)`` in ``reduction``'s form."""

    def loss(w, batch):
        error, weight = per_example(w, batch)
        if reduction == "mean":
            return jnp.mean(error**2)
        if reduction == "sum":
            return jnp.sum(error**2)
        return jnp.sum(weight * error**2), jnp.sum(weight)

    return loss


def big_batch(reduction, w, batch):
    """The big batch's loss and gradient (a weighted loss normalised)."""

    def loss(w):
        out = loss_of(reduction)(w, batch)
        return out[0] / out[1] if reduction == "weighted" else out

    return jax.value_and_grad(loss)(w)


def core(reduction, num, w, batch):
    return jax.jit(
        jaxaccum.value_and_grad(loss_of(reduction), num, reduction=reduction)
    )(w, batch)


def core_grad(reduction, num, w, batch):
    grads = jax.jit(jaxaccum.grad(loss_of(reduction), num, reduction=reduction))(
        w, batch
    )
    return None, grads


def sharded(reduction, num, w, batch):
    mesh = jax.make_mesh((1,), ("data",))
    step = jaxaccum.shard_value_and_grad(
        loss_of(reduction), num, mesh=mesh, reduction=reduction
    )
    return jax.jit(step)(w, batch)


def linen(reduction, num, w, batch):
    def loss(variables, batch):
        return loss_of(reduction)(variables["params"], batch)

    step = jaxaccum.flax.linen_value_and_grad(loss, num, reduction=reduction)
    return jax.jit(step)({"params": w}, batch)


class _Model(nnx.Module):
    def __init__(self, w):
        self.a = nnx.Param(w["a"])
        self.b = nnx.Param(w["b"])


def flax_nnx(reduction, num, w, batch):
    def loss(model, batch):
        return loss_of(reduction)({"a": model.a[...], "b": model.b[...]}, batch)

    step = jaxaccum.flax.nnx_value_and_grad(loss, num, reduction=reduction)
    value, grads = nnx.jit(step)(_Model(w), batch)
    return value, {"a": grads["a"][...], "b": grads["b"][...]}


def equinox(reduction, num, w, batch):
    step = jaxaccum.equinox.filter_value_and_grad(
        loss_of(reduction), num, reduction=reduction
    )
    return eqx.filter_jit(step)(w, batch)


FRONT_ENDS = [core, core_grad, sharded, linen, flax_nnx, equinox]


def problem(seed, num, rows):
    """Unit-scale float64 parameters and a batch of ``num * rows`` examples."""
    rng = np.random.default_rng(seed)
    size = num * rows
    w = {"a": rng.normal(size=FEATURES) / np.sqrt(FEATURES), "b": rng.normal()}
    batch = {
        "x": rng.normal(size=(size, FEATURES)),
        "y": rng.normal(size=size),
        "weight": rng.uniform(0.5, 2.0, size=size),
    }
    return jax.tree.map(jnp.asarray, (w, batch))


@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    num=st.sampled_from(NOT_POWERS_OF_TWO),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@example(num=12, rows=1, seed=0)  # the N = 12, whatever is drawn
def test_float64_window_equals_the_big_batch(front_end, num, reduction, rows, seed):
    with jax.enable_x64(True):
        w, batch = problem(seed, num, rows)
        value, grads = front_end(reduction, num, w, batch)
        expected_value, expected = big_batch(reduction, w, batch)
        assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(grads))
        chex.assert_trees_all_close(grads, expected, rtol=RTOL64, atol=ATOL64)
        if value is not None:
            chex.assert_trees_all_close(value, expected_value, rtol=RTOL64, atol=ATOL64)


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_float64_with_a_float64_accumulator(reduction):
    """Issue 62's case also held with ``accum_dtype=jnp.float64``: the share,
    not the sum, was rounded to float32."""
    with jax.enable_x64(True):
        w, batch = problem(7, 6, 2)
        step = jaxaccum.value_and_grad(
            loss_of(reduction), 6, reduction=reduction, accum_dtype=jnp.float64
        )
        value, grads = jax.jit(step)(w, batch)
        expected_value, expected = big_batch(reduction, w, batch)
        chex.assert_trees_all_close(grads, expected, rtol=RTOL64, atol=ATOL64)
        chex.assert_trees_all_close(value, expected_value, rtol=RTOL64, atol=ATOL64)
