"""FP8 with delayed scaling (Flax's ``fp8_ops``) through the window.

Each FP8 matmul keeps amax histories and scales in the
``_overwrite_with_gradient`` collection; their "gradient" is their new value,
and ``TrainState.apply_gradients`` writes it over the old. Across a window
they combine by max, and every micro-batch is differentiated at its share of
the window, so its backward's cotangents (whose amax the output-gradient
history records) are the big batch's.

Claims and tolerances. The big batch and the window quantize with the same
scales (computed from the window-start histories), so the input and kernel
histories, computed from the same float32 values, are equal bitwise. The
output-gradient amax is the max of cotangents that are the big batch's up to
float32 rounding (the same sums in another order), and the parameters'
gradients likewise: RTOL, ATOL (tests/tolerances.py). The rows differ in size
by two orders of magnitude, so averaging the maxima (6.57 for 7.54 in the
issue's example) or differentiating each micro-batch at N times the big
batch's cotangents moves them by far more.
"""

import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
from jax.sharding import AxisType
from tolerances import ATOL, RTOL

import jaxaccum

HISTORY = 8  # steps of amax history
STEPS = 3
OPS = {
    "direct": fp8_ops.Fp8DirectDotGeneralOp,
    "dot_general": fp8_ops.Fp8DotGeneralOp,  # deprecated by Flax, still used
}


class Fp8Mlp(nn.Module):
    op: type

    @nn.compact
    def __call__(self, x):
        def dense(features):
            return nn.Dense(
                features,
                dot_general_cls=lambda: self.op(amax_history_length=HISTORY),
            )

        x = nn.relu(dense(32)(x))
        return dense(4)(x)


def batch_of(key):
    kx, ky = jax.random.split(key)
    # Every 7th row is 100x the others: the window's maxima are in a few rows.
    rows = jnp.where(jnp.arange(64) % 7 == 0, 100.0, 1.0)[:, None]
    return {
        "x": jax.random.normal(kx, (64, 16)) * rows,
        "y": jax.random.normal(ky, (64, 4)),
    }


def make_state(op):
    model = Fp8Mlp(op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = model.init(jax.random.key(0), jnp.ones((1, 16)))

    def loss(variables, batch):
        out = model.apply(variables, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(1e-3)
    )
    return state, loss


def split_metadata(grads):
    """The parameters' gradients; the metadata that must equal the big
    batch's bitwise; the output-gradient histories (equal to rounding)."""
    leaves = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            grads[fp8_ops.OVERWRITE_WITH_GRADIENT]
        )
    }
    output_grad = {k: v for k, v in leaves.items() if "output_grad_amax" in k}
    exact = {k: v for k, v in leaves.items() if "output_grad_amax" not in k}
    return grads["params"], exact, output_grad


def check_step(actual, expected, step):
    params, exact, output_grad = split_metadata(actual[1])
    params_e, exact_e, output_grad_e = split_metadata(expected[1])
    chex.assert_trees_all_equal(exact, exact_e, custom_message=f"step {step}")
    chex.assert_trees_all_close(
        output_grad, output_grad_e, rtol=RTOL, atol=0, custom_message=f"step {step}"
    )
    chex.assert_trees_all_close(
        (actual[0], params),
        (expected[0], params_e),
        rtol=RTOL,
        atol=ATOL,
        custom_message=f"step {step}",
    )


def check_steps(state, big, window, steps=STEPS):
    """At each of ``steps`` optimizer steps of the big batch's training, the
    window's value and gradients (metadata included) at the same state; then
    the window's own training against the big batch's."""
    trained = {"big": state, "window": state}
    for step in range(steps):
        batch = batch_of(jax.random.key(step + 1))
        expected = big(trained["big"], batch)
        check_step(window(trained["big"], batch), expected, step)
        trained["big"] = trained["big"].apply_gradients(grads=expected[1])
        window_grads = window(trained["window"], batch)[1]
        trained["window"] = trained["window"].apply_gradients(grads=window_grads)
    chex.assert_trees_all_close(
        trained["window"].params, trained["big"].params, rtol=RTOL, atol=ATOL
    )
    return trained["big"]


@pytest.mark.parametrize("name", sorted(OPS))
def test_fp8_metadata_and_gradients_equal_the_big_batch_step_after_step(name):
    state, loss = make_state(OPS[name])
    big = jax.jit(lambda state, batch: jax.value_and_grad(loss)(state.params, batch))
    window = jax.jit(
        lambda state, batch: jaxaccum.value_and_grad(loss, 4)(state.params, batch)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        trained = check_steps(state, big, window)
    history = trained.params[fp8_ops.OVERWRITE_WITH_GRADIENT]
    filled = jax.tree.leaves(history)[0]  # Dense_0's input history
    assert int(jnp.sum(filled > 0)) == STEPS, filled  # one entry per window


def test_fp8_through_shard_value_and_grad():
    """On a mesh: the max over devices, once per window."""
    state, loss = make_state(OPS["direct"])
    big = jax.jit(lambda state, batch: jax.value_and_grad(loss)(state.params, batch))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    sharded = jaxaccum.shard_value_and_grad(loss, 4, mesh=mesh)
    check_steps(state, big, jax.jit(lambda state, batch: sharded(state.params, batch)))


def test_accumulating_fp8_metadata_as_gradients_is_visibly_wrong():
    """The tolerances above tell the max from the mean of the maxima."""
    state, loss = make_state(OPS["direct"])
    batch = batch_of(jax.random.key(1))
    expected = jax.jit(jax.value_and_grad(loss))(state.params, batch)
    actual = jax.jit(jaxaccum.value_and_grad(loss, 4))(state.params, batch)
    path = (fp8_ops.OVERWRITE_WITH_GRADIENT, "Dense_0", "Fp8DirectDotGeneralOp_0")

    def history(grads, name):
        tree = grads
        for key in path:
            tree = tree[key]
        return tree[name][0]

    micro_maxima = [
        float(jnp.max(jnp.abs(batch["x"][k::4]))) for k in range(4)
    ]  # the strided split's micro-batches
    mean_of_maxima = sum(micro_maxima) / 4
    big_max = float(history(expected[1], "input_amax_history"))
    assert big_max == max(micro_maxima)
    assert abs(mean_of_maxima - big_max) > 100 * RTOL * big_max, micro_maxima
    assert float(history(actual[1], "input_amax_history")) == big_max
