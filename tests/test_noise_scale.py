"""The gradient noise scale: unbiased estimates of |G|^2 and tr(Sigma).

The population and the tolerance are in noise_population.py (the same ones
serve the 8-device check of shard_value_and_grad in distributed_checks.py).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from noise_population import (
    FEATURES,
    WINDOWS,
    assert_unbiased,
    loss_for,
    mean_loss,
    population,
    sample,
    truth,
)

import jaxaccum


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_estimates_average_to_the_population_truth(reduction):
    x, y = population()
    w = jnp.zeros(FEATURES)
    batch_size, num = 64, 8
    loss, options = loss_for(reduction)
    step = jaxaccum.value_and_grad(loss, num, report_stats=True, **options)

    @jax.jit
    @jax.vmap
    def window(key):
        _, stats = step(w, *sample(key, x, y, batch_size, reduction))
        return stats

    stats = window(jax.random.split(jax.random.key(1), WINDOWS))
    norm_sq, trace = truth(w, x, y)
    assert_unbiased(stats.gradient_norm_sq, norm_sq, "|G|^2")
    assert_unbiased(stats.gradient_noise_trace, trace, "tr(Sigma)")
    if reduction == "mean":
        np.testing.assert_array_equal(stats.small_batch, batch_size // num)
        np.testing.assert_array_equal(stats.big_batch, batch_size)
    else:  # token counts: micro-batch weights differ, and sum to the window's
        assert len(np.unique(np.asarray(stats.small_batch))) > 1
        np.testing.assert_allclose(stats.small_batch.sum(axis=1), stats.big_batch)


def test_window_stats_are_the_norms_they_say():
    x, y = population()
    w = jnp.ones(FEATURES)
    (value, grads), stats = jax.jit(
        jaxaccum.value_and_grad(mean_loss, 4, batch_argnums=(1, 2), report_stats=True)
    )(w, x[:64], y[:64])
    micro_grads = [
        jax.grad(mean_loss)(w, mx, my)
        for mx, my in zip(
            jaxaccum.split_batch(x[:64], 4),
            jaxaccum.split_batch(y[:64], 4),
            strict=True,
        )
    ]
    np.testing.assert_allclose(
        stats.microbatch_grad_sq_norm, [g @ g for g in micro_grads], rtol=1e-5
    )
    np.testing.assert_allclose(stats.grad_sq_norm, grads @ grads, rtol=1e-5)
    assert stats.finite and stats.microbatch_finite.shape == (4,)
    np.testing.assert_allclose(
        stats.noise_scale, stats.gradient_noise_trace / stats.gradient_norm_sq
    )


def test_grad_and_equinox_filter_grad_report_stats_too():
    import equinox as eqx

    import jaxaccum.equinox

    x, y = population()
    w = jnp.ones(FEATURES)
    grads, stats = jaxaccum.grad(mean_loss, 4, batch_argnums=(1, 2), report_stats=True)(
        w, x[:64], y[:64]
    )
    chex.assert_trees_all_close(grads, jax.grad(mean_loss)(w, x[:64], y[:64]))
    assert stats.microbatch_grad_sq_norm.shape == (4,)

    model = eqx.nn.Linear(FEATURES, "scalar", key=jax.random.key(0))

    def model_loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    grads, stats = jaxaccum.equinox.filter_grad(
        model_loss, 4, batch_argnums=(1, 2), report_stats=True
    )(model, x[:64], y[:64])
    assert grads.weight.shape == model.weight.shape
    assert np.isfinite(stats.noise_scale)


def test_one_microbatch_gives_nan_estimates_not_an_error():
    x, y = population()
    _, stats = jaxaccum.value_and_grad(
        mean_loss, 1, batch_argnums=(1, 2), report_stats=True
    )(jnp.ones(FEATURES), x[:8], y[:8])
    assert np.isnan(stats.gradient_norm_sq) and np.isnan(stats.noise_scale)
    assert np.isfinite(stats.grad_sq_norm)


def test_report_stats_and_report_finite_together_is_refused():
    with pytest.raises(ValueError, match="pass report_stats alone"):
        jaxaccum.value_and_grad(mean_loss, 2, report_finite=True, report_stats=True)


def test_multisteps_estimates_equal_the_in_step_ones():
    x, y = population()
    w = jnp.ones(FEATURES)
    batch_x, batch_y, num = x[:64], y[:64], 4
    _, stats = jaxaccum.value_and_grad(
        mean_loss, num, batch_argnums=(1, 2), report_stats=True
    )(w, batch_x, batch_y)

    optimizer = jaxaccum.MultiSteps(optax.sgd(0.1), num, track_noise_scale=True)
    state = optimizer.init(w)
    for micro_x, micro_y in zip(
        jaxaccum.split_batch(batch_x, num),
        jaxaccum.split_batch(batch_y, num),
        strict=True,
    ):
        assert np.isnan(optimizer.noise_estimates(state).noise_scale)  # mid-window
        grads = jax.grad(mean_loss)(w, micro_x, micro_y)
        _, state = optimizer.update(grads, state, w, weight=micro_x.shape[0])
    estimates = optimizer.noise_estimates(state)
    chex.assert_trees_all_close(
        tuple(estimates),
        (stats.gradient_norm_sq, stats.gradient_noise_trace, stats.noise_scale),
        rtol=1e-4,
    )
    with pytest.raises(ValueError, match="track_noise_scale=True"):
        jaxaccum.MultiSteps(optax.sgd(0.1), num).noise_estimates(state)


def test_ema_averages_numerator_and_denominator_then_divides(tmp_path):
    ema = jaxaccum.NoiseScaleEMA(decay=0.5)
    state = ema.init()
    assert np.isnan(ema.noise_scale(state))
    windows = [(4.0, 8.0), (float("nan"), float("nan")), (2.0, 12.0)]
    for norm_sq, trace in windows:
        stats = jaxaccum.NoiseEstimates(
            jnp.float32(norm_sq), jnp.float32(trace), jnp.float32(trace / norm_sq)
        )
        state = jax.jit(ema.update)(state, stats)
    assert int(state.num_windows) == 2  # the NaN window is skipped
    # Bias-corrected: (0.5 * 0.5 * 4 + 0.5 * 2) / (1 - 0.25) = 2 / 0.75, and
    # (0.5 * 0.5 * 8 + 0.5 * 12) / 0.75 = 8 / 0.75: their ratio, not the
    # mean of the windows' ratios (2 and 6).
    np.testing.assert_allclose(ema.gradient_norm_sq(state), 2.0 / 0.75, rtol=1e-6)
    np.testing.assert_allclose(ema.gradient_noise_trace(state), 8.0 / 0.75, rtol=1e-6)
    np.testing.assert_allclose(ema.noise_scale(state), 4.0, rtol=1e-6)

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ema", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ema", ema.init())
    chex.assert_trees_all_equal(tuple(restored), tuple(state))


def test_flax_nnx_helper_reports_stats():
    from flax import nnx

    import jaxaccum.flax

    model = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))
    x, y = population()

    def loss(model, batch):
        return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)

    (value, grads), stats = jaxaccum.flax.nnx_value_and_grad(
        loss, 4, report_stats=True
    )(model, {"x": x[:64], "y": y[:64]})
    assert stats.microbatch_grad_sq_norm.shape == (4,)
    assert np.isfinite(stats.noise_scale)
