"""jaxaccum.equinox against eqx.filter_value_and_grad on the full batch.

Tolerances (float32): values and gradients agree with the full batch to
RTOL, ATOL (tests/tolerances.py) (summation order is the only difference); BatchNorm's
state after a window equals N sequential passes to the same tolerance.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerances import ATOL, RTOL

import jaxaccum
import jaxaccum.equinox

# Float32 rounding bounds, derived in tests/tolerances.py.


class Net(eqx.Module):
    """LayerNorm then an MLP whose activation (relu) is not an array."""

    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    scale: int = eqx.field(static=True, default=2)

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(6)
        self.mlp = eqx.nn.MLP(6, 3, width_size=16, depth=2, key=key)

    def __call__(self, x):
        return self.mlp(self.norm(x)) * self.scale


def data(batch_size=32):
    kx, ky, km = jax.random.split(jax.random.key(1), 3)
    return (
        jax.random.normal(kx, (batch_size, 6)),
        jax.random.randint(ky, (batch_size,), 0, 3),
        jax.random.bernoulli(km, 0.7, (batch_size,)),
    )


def mean_loss(model, x, y):
    logits = jax.vmap(model)(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def weighted_loss(model, x, y, mask):
    losses = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y)
    return jaxaccum.masked_sum(losses, mask)


def masked_mean(model, x, y, mask):
    loss_sum, count = weighted_loss(model, x, y, mask)
    return loss_sum / count


@pytest.fixture(scope="module")
def model():
    return Net(jax.random.key(0))


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 8])
def test_mean_loss_matches_eqx_filter_value_and_grad(model, num_microbatches):
    x, y, _ = data()
    accumulated = eqx.filter_jit(
        jaxaccum.equinox.filter_value_and_grad(
            mean_loss, num_microbatches, batch_argnums=(1, 2)
        )
    )
    value, grads = accumulated(model, x, y)
    want_value, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(mean_loss))(
        model, x, y
    )
    assert grads.mlp.activation is None and grads.scale == 2  # static kept
    chex.assert_trees_all_close(
        (value, grads), (want_value, want_grads), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 8])
def test_weighted_loss_matches_the_full_batch_masked_mean(model, num_microbatches):
    x, y, mask = data()
    value, grads = eqx.filter_jit(
        jaxaccum.equinox.filter_value_and_grad(
            weighted_loss,
            num_microbatches,
            batch_argnums=(1, 2, 3),
            reduction="weighted",
        )
    )(model, x, y, mask)
    want = eqx.filter_value_and_grad(masked_mean)(model, x, y, mask)
    chex.assert_trees_all_close((value, grads), want, rtol=RTOL, atol=ATOL)
    jaxaccum.equinox.filter_assert_grads_match_full_batch(
        weighted_loss,
        model,
        x,
        y,
        mask,
        num_microbatches=num_microbatches,
        batch_argnums=(1, 2, 3),
        reduction="weighted",
    )


def test_filter_grad_returns_grads_and_aux_like_eqx_filter_grad(model):
    x, y, _ = data()

    def with_aux(model, x, y):
        return mean_loss(model, x, y), {"first": jax.vmap(model)(x)[:, 0]}

    grads, aux = jaxaccum.equinox.filter_grad(
        with_aux, 4, batch_argnums=(1, 2), has_aux=True, aux_reduction="concat"
    )(model, x, y)
    want_grads, want_aux = eqx.filter_grad(with_aux, has_aux=True)(model, x, y)
    chex.assert_trees_all_close(
        (grads, aux), (want_grads, want_aux), rtol=RTOL, atol=ATOL
    )


class DropoutNet(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(8, 8, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, key):
        return self.dropout(self.linear(x), key=key)


def dropout_loss(model, x, key):
    keys = jax.random.split(key, x.shape[0])
    out = jax.vmap(model)(x, keys)
    return jnp.mean(out**2), out != 0  # aux: the dropout mask


def test_dropout_keys_differ_per_microbatch_and_repeat_bitwise():
    model = DropoutNet(jax.random.key(0))
    x = jnp.ones((16, 8))  # identical examples: only the keys tell them apart
    step = eqx.filter_jit(
        jaxaccum.equinox.filter_value_and_grad(
            dropout_loss, 4, key_argnums=2, has_aux=True, aux_reduction="stack"
        )
    )
    (value, masks), grads = step(model, x, jax.random.key(3))
    per_microbatch = {np.asarray(m).tobytes() for m in masks}
    assert len(per_microbatch) == 4, "micro-batches drew the same dropout masks"
    (again, masks_again), grads_again = step(model, x, jax.random.key(3))
    chex.assert_trees_all_equal(
        (value, masks, grads), (again, masks_again, grads_again)
    )


class BatchNormNet(eqx.Module):
    """Linear, BatchNorm (batch statistics in training), relu, linear readout."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    readout: eqx.nn.Linear

    def __init__(self, key):
        first, second = jax.random.split(key)
        self.linear = eqx.nn.Linear(6, 8, key=first)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.readout = eqx.nn.Linear(8, "scalar", key=second)

    def __call__(self, x, state):
        hidden, state = self.norm(self.linear(x), state)
        return self.readout(jax.nn.relu(hidden)), state


def batchnorm_loss(model, state, x):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    out, state = batched(x, state)
    return jnp.mean((out - jnp.sum(x, axis=1)) ** 2), state


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_batchnorm_state_equals_sequential_passes(num_microbatches):
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0))
    x, _, _ = data()
    (value, grads), new_state = eqx.filter_jit(
        jaxaccum.equinox.filter_value_and_grad(
            batchnorm_loss, num_microbatches, batch_argnums=2, state_argnums=1
        )
    )(model, state, x)
    expected = state
    for micro_batch in jaxaccum.split_batch(x, num_microbatches):
        _, expected = batchnorm_loss(model, expected, micro_batch)
    chex.assert_trees_all_close(new_state, expected, rtol=RTOL, atol=ATOL)
    assert not np.allclose(
        jax.tree.leaves(new_state)[-1], jax.tree.leaves(state)[-1]
    ), "the running statistics did not move"

    diagnosis = jaxaccum.equinox.filter_diagnose(
        batchnorm_loss,
        model,
        state,
        x,
        num_microbatches=num_microbatches,
        batch_argnums=2,
        state_argnums=1,
    )
    assert [cause.kind for cause in diagnosis.causes] == ["batch_dependent"]
    assert any(".linear.weight" in error.path for error in diagnosis.leaf_errors)


def test_filter_jit_train_step_compiles_once_over_20_steps(model):
    x, y, _ = data()
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    traces = []

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        traces.append(1)
        loss, grads = jaxaccum.equinox.filter_value_and_grad(
            mean_loss, 4, batch_argnums=(1, 2)
        )(model, x, y)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(20):
        model, opt_state, loss = train_step(model, opt_state, x, y)
        losses.append(float(loss))
    assert len(traces) == 1, f"traced {len(traces)} times"
    assert losses[-1] < losses[0], losses


def test_jax_jit_on_a_partitioned_model(model):
    x, y, _ = data()
    arrays, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def step(arrays, x, y):
        return jaxaccum.equinox.filter_value_and_grad(
            mean_loss, 4, batch_argnums=(1, 2)
        )(eqx.combine(arrays, static), x, y)

    chex.assert_trees_all_close(
        step(arrays, x, y),
        eqx.filter_value_and_grad(mean_loss)(model, x, y),
        rtol=RTOL,
        atol=ATOL,
    )


def test_multisteps_with_the_equinox_pattern_equals_one_big_batch_step(model):
    x, y, _ = data()
    every_k = 4
    optimizer = jaxaccum.MultiSteps(optax.adam(1e-2), every_k_schedule=every_k)
    params = eqx.filter(model, eqx.is_array)
    opt_state = optimizer.init(params)
    accumulated = model
    for micro_x, micro_y in zip(
        jaxaccum.split_batch(x, every_k), jaxaccum.split_batch(y, every_k), strict=True
    ):
        grads = eqx.filter_grad(mean_loss)(accumulated, micro_x, micro_y)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(accumulated, eqx.is_array)
        )
        accumulated = eqx.apply_updates(accumulated, updates)
    assert bool(optimizer.has_updated(opt_state))

    adam = optax.adam(1e-2)
    big_grads = eqx.filter_grad(mean_loss)(model, x, y)
    updates, _ = adam.update(big_grads, adam.init(params), params)
    chex.assert_trees_all_close(
        eqx.filter(accumulated, eqx.is_array),
        eqx.filter(eqx.apply_updates(model, updates), eqx.is_array),
        rtol=RTOL,
        atol=ATOL,
    )


def test_bad_inputs_get_the_cores_errors(model):
    x, y, _ = data()
    accumulate = jaxaccum.equinox.filter_value_and_grad(
        mean_loss, 5, batch_argnums=(1, 2)
    )
    with pytest.raises(ValueError, match="Batch size 32 is not divisible by"):
        accumulate(model, x, y)
    with pytest.raises(ValueError, match=r"args\[1\]: 32, args\[2\]: 16"):
        jaxaccum.equinox.filter_value_and_grad(mean_loss, 4, batch_argnums=(1, 2))(
            model, x, y[:16]
        )
    with pytest.raises(ValueError, match="Pass exactly one of num_microbatches"):
        jaxaccum.equinox.filter_value_and_grad(mean_loss)
    with pytest.raises(TypeError, match="argnums"):
        jaxaccum.equinox.filter_grad(mean_loss, 4, argnums=1)


@pytest.mark.parametrize(
    "check", ["filter_diagnose", "filter_assert_grads_match_full_batch"]
)
def test_the_checks_refuse_a_loss_scale_under_their_own_name(check):
    """They listed loss_scale among their options, then refused it under
    the core check's name (issue 45)."""
    with pytest.raises(TypeError, match=rf"{check} does not take loss_scale"):
        getattr(jaxaccum.equinox, check)(None, None, loss_scale=True)
    with pytest.raises(TypeError, match="unknown keyword") as info:
        getattr(jaxaccum.equinox, check)(None, None, rduction="sum")
    assert "loss_scale" not in str(info.value)
