"""jaxaccum.value_and_grad / grad against the full-batch gradient.

Tolerances (float32): values and gradients agree with the full batch to
RTOL, ATOL (tests/tolerances.py) (summation order is the only difference).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import (
    AttentionBlock,
    SmallCNN,
    classification_batch,
    flax_loss,
    mlp_apply,
    mlp_loss,
    mlp_loss_with_aux,
    mlp_params,
)
from tolerances import ATOL, ATOL64, RTOL, RTOL64

import jaxaccum
from jaxaccum.testing import assert_grads_match_full_batch

# Float32 rounding bounds, derived in tests/tolerances.py.
NUM_MICROBATCHES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def mlp():
    return mlp_params(jax.random.key(0)), classification_batch(jax.random.key(1), 32)


@pytest.mark.parametrize("num_microbatches", NUM_MICROBATCHES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mlp_matches_full_batch(mlp, num_microbatches, reduction):
    params, batch = mlp

    def sum_loss(params, batch):
        return mlp_loss(params, batch) * batch["y"].shape[0]

    fun = mlp_loss if reduction == "mean" else sum_loss
    assert_grads_match_full_batch(
        fun,
        params,
        batch,
        num_microbatches=num_microbatches,
        reduction=reduction,
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.mark.parametrize("num_microbatches", NUM_MICROBATCHES)
@pytest.mark.parametrize(
    "module, shape",
    [(SmallCNN(), (16, 8, 8, 2)), (AttentionBlock(), (16, 5, 8))],
    ids=["cnn_groupnorm", "attention"],
)
def test_flax_models_match_full_batch(module, shape, num_microbatches):
    x = jax.random.normal(jax.random.key(2), shape)
    batch = {"x": x, "y": jax.random.randint(jax.random.key(3), (shape[0],), 0, 3)}
    params = module.init(jax.random.key(4), x[:1])["params"]
    assert_grads_match_full_batch(
        flax_loss(module),
        params,
        batch,
        num_microbatches=num_microbatches,
        rtol=RTOL,
        atol=ATOL,
    )


def test_result_equals_jax_value_and_grad_directly(mlp):
    params, batch = mlp
    expected = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    actual = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_microbatches=4))(
        params, batch
    )
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)


def test_one_microbatch_is_exactly_jax_value_and_grad(mlp):
    params, batch = mlp
    expected = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    actual = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_microbatches=1))(
        params, batch
    )
    chex.assert_trees_all_equal(actual, expected)


def test_microbatch_size_equals_num_microbatches(mlp):
    params, batch = mlp
    by_count = jaxaccum.value_and_grad(mlp_loss, num_microbatches=4)(params, batch)
    by_size = jaxaccum.value_and_grad(mlp_loss, microbatch_size=8)(params, batch)
    chex.assert_trees_all_equal(by_count, by_size)


def test_aux_reductions(mlp):
    params, batch = mlp
    num = 4
    fun = jaxaccum.value_and_grad(
        mlp_loss_with_aux,
        num,
        has_aux=True,
        aux_reduction={"accuracy": "mean", "correct": "sum", "first_loss": "stack"},
    )
    (value, aux), grads = jax.jit(fun)(params, batch)
    (full_value, full_aux), full_grads = jax.value_and_grad(
        mlp_loss_with_aux, has_aux=True
    )(params, batch)
    chex.assert_trees_all_close(
        (value, grads), (full_value, full_grads), rtol=RTOL, atol=ATOL
    )
    chex.assert_trees_all_close(
        aux["accuracy"], full_aux["accuracy"], rtol=RTOL, atol=ATOL
    )
    assert aux["correct"].dtype == full_aux["correct"].dtype
    assert int(aux["correct"]) == int(full_aux["correct"])
    # "stack": micro-batch k's first example is example k of the batch.
    chex.assert_shape(aux["first_loss"], (num,))
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        mlp_apply(params, batch["x"]), batch["y"]
    )
    chex.assert_trees_all_close(
        aux["first_loss"], per_example[:num], rtol=RTOL, atol=ATOL
    )


def test_aux_last_and_integer_mean(mlp):
    params, batch = mlp
    num = 4

    def fun(params, batch):
        loss, aux = mlp_loss_with_aux(params, batch)
        return loss, (aux["first_loss"], aux["correct"])

    (_, (last, mean_correct)), _ = jaxaccum.value_and_grad(
        fun, num, has_aux=True, aux_reduction=("last", "mean")
    )(params, batch)
    microbatches = jaxaccum.split_batch(batch, num)
    last_micro = jax.tree.map(lambda x: x[-1], microbatches)
    chex.assert_trees_all_close(
        last, fun(params, last_micro)[1][0], rtol=RTOL, atol=ATOL
    )
    # An integer leaf averaged over micro-batches is a float mean, not truncated.
    assert jnp.issubdtype(mean_correct.dtype, jnp.floating)
    full_correct = mlp_loss_with_aux(params, batch)[1]["correct"]
    np.testing.assert_allclose(mean_correct, full_correct / num, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_one_aux_reduction_for_all_leaves_stack(mlp, num_microbatches):
    params, batch = mlp
    (_, aux), _ = jaxaccum.value_and_grad(
        mlp_loss_with_aux, num_microbatches, has_aux=True, aux_reduction="stack"
    )(params, batch)
    for leaf in jax.tree.leaves(aux):
        assert leaf.shape[0] == num_microbatches


def test_grad_only(mlp):
    params, batch = mlp
    grads = jaxaccum.grad(mlp_loss, num_microbatches=4)(params, batch)
    chex.assert_trees_all_close(
        grads, jax.grad(mlp_loss)(params, batch), rtol=RTOL, atol=ATOL
    )
    grads, aux = jaxaccum.grad(mlp_loss_with_aux, num_microbatches=4, has_aux=True)(
        params, batch
    )
    chex.assert_trees_all_close(
        grads, jax.grad(mlp_loss)(params, batch), rtol=RTOL, atol=ATOL
    )
    assert set(aux) == {"accuracy", "correct", "first_loss"}


def test_several_argnums_and_batch_args_and_passthrough():
    key = jax.random.key(5)
    w, b = jax.random.normal(key, (4, 2)), jnp.ones(2)
    x, y = jax.random.normal(jax.random.key(6), (12, 4)), jnp.zeros((12, 2))

    def loss(w, x, b, y, scale, *, power):
        return scale * jnp.mean(jnp.abs(x @ w + b - y) ** power)

    fun = jaxaccum.value_and_grad(loss, 3, argnums=(0, 2), batch_argnums=(1, 3))
    actual = fun(w, x, b, y, 0.5, power=3)
    expected = jax.value_and_grad(loss, argnums=(0, 2))(w, x, b, y, 0.5, power=3)
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    assert isinstance(actual[1], tuple) and len(actual[1]) == 2


def test_remat_and_unroll_do_not_change_the_result(mlp):
    params, batch = mlp
    plain = jax.jit(jaxaccum.value_and_grad(mlp_loss, 4))(params, batch)
    for kwargs in (
        {"remat": True},
        {"remat": jax.checkpoint_policies.nothing_saveable},
        {"unroll": 2},
    ):
        other = jax.jit(jaxaccum.value_and_grad(mlp_loss, 4, **kwargs))(params, batch)
        chex.assert_trees_all_close(other, plain, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "remat",
    [
        True,
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.everything_saveable,
    ],
    ids=["true", "dots_saveable", "everything_saveable"],
)
def test_remat_policy_with_complex_parameters_is_the_big_batch(remat):
    """A policy that saves complex values failed inside JAX (its checkpoint
    rounds saved values with reduce_precision, which takes no complex dtype):
    complex values are recomputed, and the window is the big batch's, in
    float64 within the derived float64 bound (tests/tolerances.py)."""

    def loss(w, x):
        return jnp.mean(jnp.abs(jnp.tanh(x @ w)) ** 2)

    with jax.enable_x64(True):
        w = (jnp.arange(6.0).reshape(3, 2) + 1j * jnp.ones((3, 2))) / 7
        x = jnp.linspace(-1, 1, 24).reshape(8, 3).astype(jnp.complex128)
        big = jax.value_and_grad(loss)(w, x)
        got = jax.jit(jaxaccum.value_and_grad(loss, 4, remat=remat))(w, x)
        chex.assert_trees_all_close(got, big, rtol=RTOL64, atol=ATOL64)


def test_remat_puts_checkpoint_in_the_program(mlp):
    params, batch = mlp
    jaxpr = jax.make_jaxpr(jaxaccum.value_and_grad(mlp_loss, 4, remat=True))(
        params, batch
    )
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)
    plain = jax.make_jaxpr(jaxaccum.value_and_grad(mlp_loss, 4))(params, batch)
    assert "checkpoint" not in str(plain) and "remat" not in str(plain)


def test_bfloat16_params_float32_accumulator_is_closer_to_float64():
    """Why accum_dtype defaults to float32: bfloat16 sums lose the small terms."""
    num, batch_size, features = 64, 1024, 32
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, features)).astype(np.float32)
    y = rng.normal(size=(batch_size,)).astype(np.float32)
    w = rng.normal(size=(features,)).astype(np.float32)
    x16, y16, w16 = (jnp.asarray(a, jnp.bfloat16) for a in (x, y, w))

    def loss(w, batch):
        x, y = batch
        return jnp.mean((x @ w - y) ** 2)

    # float64 reference on the same (bfloat16-rounded) numbers.
    x64, y64, w64 = (np.asarray(a, np.float64) for a in (x16, y16, w16))
    reference = 2.0 / batch_size * x64.T @ (x64 @ w64 - y64)

    def error(accum_dtype):
        grads = jax.jit(jaxaccum.grad(loss, num, accum_dtype=accum_dtype))(
            w16, (x16, y16)
        )
        assert grads.dtype == jnp.bfloat16
        return float(np.abs(np.asarray(grads, np.float64) - reference).mean())

    float32_error, bfloat16_error = error(jnp.float32), error(None)
    assert float32_error * 3 < bfloat16_error, (
        f"float32 accumulator error {float32_error:.3g} should be well below the "
        f"bfloat16 accumulator error {bfloat16_error:.3g}"
    )


def test_gradient_dtype_is_kept_for_each_leaf():
    params = {
        "f32": jnp.ones(3),
        "bf16": jnp.ones(3, jnp.bfloat16),
        "f16": jnp.ones(3, jnp.float16),
    }

    def loss(params, x):
        total = sum(jnp.sum(p.astype(jnp.float32)) for p in params.values())
        return jnp.mean(x) * total

    grads = jaxaccum.grad(loss, 4)(params, jnp.ones(8))
    for name, leaf in grads.items():
        assert leaf.dtype == params[name].dtype, name


def dropout_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    mask_id = jnp.sum(keep * (2 ** jnp.arange(x.shape[-1])))
    return jnp.mean(jnp.where(keep, x, 0.0) @ w), jax.random.uniform(key), mask_id


def test_each_microbatch_gets_its_own_key():
    num = 8
    w, x = jnp.ones(16), jnp.ones((32, 16))

    def fun(w, x, key):
        loss, draw, mask_id = dropout_loss(w, x, key)
        return loss, (draw, mask_id)

    accumulated = jax.jit(
        jaxaccum.value_and_grad(
            fun, num, key_argnums=2, has_aux=True, aux_reduction="stack"
        )
    )
    key = jax.random.key(7)
    (_, (draws, mask_ids)), grads = accumulated(w, x, key)
    assert len(set(np.asarray(draws).tolist())) == num, draws
    assert len(set(np.asarray(mask_ids).tolist())) > 1, mask_ids
    # The documented keys: jax.random.split(key, N)[k] for micro-batch k.
    expected = [float(jax.random.uniform(k)) for k in jax.random.split(key, num)]
    np.testing.assert_array_equal(np.asarray(draws), np.asarray(expected, np.float32))
    (_, again), grads_again = accumulated(w, x, key)
    chex.assert_trees_all_equal((draws, grads), (again[0], grads_again))
    (_, other), _ = accumulated(w, x, jax.random.key(8))
    assert not np.array_equal(np.asarray(other[0]), np.asarray(draws))


def test_raw_uint32_keys_are_split_too():
    w, x = jnp.ones(4), jnp.ones((8, 4))

    def fun(w, x, key):
        return jnp.mean(x @ w) * jax.random.uniform(key)

    raw = jax.random.PRNGKey(0)
    value, _ = jaxaccum.value_and_grad(fun, 2, key_argnums=2)(w, x, raw)
    expected = np.mean([4 * jax.random.uniform(k) for k in jax.random.split(raw, 2)])
    np.testing.assert_allclose(value, expected, rtol=RTOL, atol=ATOL)


def test_one_microbatch_passes_the_key_unchanged():
    w, x, key = jnp.ones(4), jnp.ones((8, 4)), jax.random.key(3)

    def fun(w, x, key):
        return dropout_loss(w, x, key)[0]

    chex.assert_trees_all_equal(
        jaxaccum.value_and_grad(fun, 1, key_argnums=2)(w, x, key),
        jax.value_and_grad(fun)(w, x, key),
    )


def test_compiled_once_and_body_traced_once_whatever_n(mlp):
    params, batch = mlp
    traces = []

    def counted_loss(params, batch):
        traces.append(1)
        return mlp_loss(params, batch)

    counts = {}
    for num in (2, 16):
        traces.clear()
        jax.jit(jaxaccum.value_and_grad(counted_loss, num)).lower(params, batch)
        counts[num] = len(traces)
    assert counts[2] == counts[16] <= 2, counts

    optimizer = optax.adam(1e-2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def train_step(params, opt_state, batch):
        loss, grads = jaxaccum.value_and_grad(mlp_loss, 4)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for step in range(5):
        batch = classification_batch(jax.random.key(step), 32)
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    assert train_step._cache_size() == 1
    assert all(np.isfinite(losses))


@st.composite
def batch_problems(draw):
    """A random batch pytree, matching params, and a divisor N of its size."""
    num = draw(st.integers(1, 4))
    batch_size = num * draw(st.integers(1, 3))
    shapes = draw(
        st.lists(
            st.lists(st.integers(1, 3), max_size=2).map(tuple), min_size=1, max_size=3
        )
    )
    layout = draw(st.sampled_from(["dict", "tuple", "nested"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    leaves = [rng.normal(size=(batch_size, *s)).astype(np.float32) for s in shapes]
    weights = [rng.normal(size=s).astype(np.float32) for s in shapes]

    def arrange(items):
        if layout == "dict":
            return {f"leaf{i}": jnp.asarray(a) for i, a in enumerate(items)}
        if layout == "tuple":
            return tuple(jnp.asarray(a) for a in items)
        return {
            "first": jnp.asarray(items[0]),
            "rest": [jnp.asarray(a) for a in items[1:]],
        }

    return num, arrange(weights), arrange(leaves)


def tree_loss(params, batch):
    per_example = sum(
        jnp.tanh(jnp.sum(x * w, axis=tuple(range(1, x.ndim))))
        for w, x in zip(jax.tree.leaves(params), jax.tree.leaves(batch), strict=True)
    )
    return jnp.mean(per_example**2)


@settings(max_examples=25, deadline=None)
@given(batch_problems())
def test_property_any_pytree_any_divisor_matches_full_batch(problem):
    num, params, batch = problem
    assert_grads_match_full_batch(
        tree_loss, params, batch, num_microbatches=num, rtol=RTOL, atol=ATOL
    )


def running_mean_loss(w, x, state):
    """A loss that, like BatchNorm, updates running statistics of its input."""
    new_state = {
        "mean": 0.9 * state["mean"] + 0.1 * jnp.mean(x, axis=0),
        "calls": state["calls"] + 1,
    }
    return jnp.mean(jnp.tanh(x @ w)), new_state


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_state_is_threaded_through_microbatches_in_order(num_microbatches):
    w = jnp.ones(3)
    x = jax.random.normal(jax.random.key(9), (16, 3))
    state = {"mean": jnp.zeros(3), "calls": jnp.array(0)}
    (value, grads), new_state = jax.jit(
        jaxaccum.value_and_grad(running_mean_loss, num_microbatches, state_argnums=2)
    )(w, x, state)

    expected_state = state
    for micro_batch in jaxaccum.split_batch(x, num_microbatches):
        _, expected_state = running_mean_loss(w, micro_batch, expected_state)
    chex.assert_trees_all_close(new_state, expected_state, rtol=RTOL, atol=ATOL)
    assert int(new_state["calls"]) == num_microbatches
    expected = jax.value_and_grad(lambda w, x: running_mean_loss(w, x, state)[0])(w, x)
    chex.assert_trees_all_close((value, grads), expected, rtol=RTOL, atol=ATOL)
    grads_only, grad_state = jaxaccum.grad(
        running_mean_loss, num_microbatches, state_argnums=2
    )(w, x, state)
    chex.assert_trees_all_close(
        (grads_only, grad_state), (grads, new_state), rtol=RTOL, atol=ATOL
    )


def test_state_that_changes_shape_is_named():
    def bad(w, x, state):
        return jnp.mean(x @ w), {"mean": jnp.zeros(4), "calls": state["calls"]}

    state = {"mean": jnp.zeros(3), "calls": jnp.array(0)}
    with pytest.raises(ValueError, match=r"State leaf args\[2\]\['mean'\] comes back"):
        jaxaccum.value_and_grad(bad, 2, state_argnums=2)(
            jnp.ones(3), jnp.ones((4, 3)), state
        )


def test_grad_with_report_finite_returns_grads_and_report(mlp):
    params, batch = mlp
    bad = dict(batch, x=batch["x"].at[2].set(jnp.nan))  # micro-batch 2 of 4
    grads, report = jaxaccum.grad(mlp_loss, 4, report_finite=True)(params, bad)
    assert report.microbatch_finite.tolist() == [True, True, False, True]
    assert not bool(report.finite)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
