"""The gradient noise scale: unbiased estimates of |G|^2 and tr(Sigma).

The population and the tolerance are in noise_population.py (the same ones
serve the 8-device check of shard_value_and_grad in distributed_checks.py).
"""

import warnings
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from noise_average import per_example_average
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
import jaxaccum.growth


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


class Window(NamedTuple):
    """What NoiseScaleEMA reads of a WindowStats."""

    big_batch: float
    gradient_norm_sq: float
    gradient_noise_trace: float


def test_ema_averages_numerator_and_denominator_per_example_then_divides(tmp_path):
    """Windows of 64 and 128 examples (and a NaN one of 32, left out) at a
    half-life of 64: factors 2**-1 and 2**-2, exact in float32, so the
    averages are a few roundings (relative 1e-6 allowed) from their value."""
    ema = jaxaccum.growth.NoiseScaleEMA(half_life=64)
    state = ema.init()
    assert np.isnan(ema.noise_scale(state))
    windows = [Window(64, 4.0, 8.0), Window(32, np.nan, np.nan), Window(128, 2, 12)]
    for window in windows:
        state = jax.jit(ema.update)(state, jax.tree.map(jnp.float32, window))
    assert int(state.num_windows) == 2  # the NaN window is skipped
    norm_sq, trace = per_example_average(windows, half_life=64)
    # Weights 1/8 and 3/4: (4 / 8 + 2 * 3 / 4) / (7 / 8) = 16 / 7, and
    # (8 / 8 + 12 * 3 / 4) / (7 / 8) = 80 / 7: their ratio, 5, is not the
    # mean of the windows' ratios (2 and 6).
    np.testing.assert_allclose((norm_sq, trace), (16 / 7, 80 / 7), rtol=1e-15)
    np.testing.assert_allclose(ema.gradient_norm_sq(state), norm_sq, rtol=1e-6)
    np.testing.assert_allclose(ema.gradient_noise_trace(state), trace, rtol=1e-6)
    np.testing.assert_allclose(ema.noise_scale(state), 5.0, rtol=1e-6)

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


# Exact WindowStats against per-micro-batch gradients of the mean loss. The
# data keep every float32 sum free of cancellation: x > 0 and residuals
# x @ w - y > 0, so each gradient entry sums positive terms, and a float32 sum
# of n positive terms is within n eps of its value, in any order (whatever
# vector code XLA picks for the host's CPU).
EPS = float(jnp.finfo(jnp.float32).eps)
NUM_EXACT, FEATURES_EXACT = 4, 4


def positive_data(batch_size):
    kx, ky, km = jax.random.split(jax.random.key(3), 3)
    x = jax.random.uniform(kx, (batch_size, FEATURES_EXACT), minval=0.5, maxval=1.5)
    y = jax.random.uniform(ky, (batch_size,), minval=-1.0, maxval=1.0)
    mask = jax.random.bernoulli(km, 0.7, (batch_size,))
    return jnp.ones(FEATURES_EXACT), x, y, mask  # residuals in [1, 7]


def squares(w, x, y):
    return 0.5 * (x @ w - y) ** 2


def mean_of_squares(w, x, y):
    return jnp.mean(squares(w, x, y))


def sum_of_squares(w, x, y, example_mask=None):
    keep = jnp.ones(x.shape[0], bool) if example_mask is None else example_mask
    return jnp.sum(jnp.where(keep, squares(w, x, y), 0.0))


def weighted_squares(w, x, y, mask, example_mask=None):
    keep = mask if example_mask is None else mask & example_mask
    return jaxaccum.masked_sum(squares(w, x, y), keep)


def masked_mean_of_squares(w, x, y, mask):
    return jnp.sum(jnp.where(mask, squares(w, x, y), 0.0)) / jnp.sum(mask)


def reference_stats(w, x, y, mask, num):
    """float64 WindowStats fields from jax.grad of each strided micro-batch's
    mean loss (rows k, k + num, ...; padded rows are past the batch's end),
    and the conditioning of the two estimators."""
    weights, grads = [], []
    for k in range(num):
        rows = (x[k::num], y[k::num], mask[k::num])
        weights.append(float(np.sum(rows[2])))
        grad = jax.grad(masked_mean_of_squares)(w, *rows) if weights[-1] else 0 * w
        grads.append(np.asarray(grad, np.float64))
    weights, grads = np.array(weights), np.array(grads)
    big = weights.sum()
    small = big / np.count_nonzero(weights)
    micro_sq = np.sum(grads**2, axis=1)
    small_sq = weights @ micro_sq / big
    big_sq = np.sum((weights @ grads / big) ** 2)
    norm_sq = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1 / small - 1 / big)
    expected = {
        "microbatch_grad_sq_norm": micro_sq,
        "grad_sq_norm": big_sq,
        "small_batch": weights,
        "big_batch": big,
        "gradient_norm_sq": norm_sq,
        "gradient_noise_trace": trace,
        "noise_scale": trace / norm_sq,
    }
    conditioning = (
        (big * big_sq + small * small_sq) / abs(big * big_sq - small * small_sq),
        (small_sq + big_sq) / abs(small_sq - big_sq),
    )
    return expected, conditioning


def assert_stats_match(stats, expected, conditioning, batch_size, num):
    # A gradient entry sums at most n = B + N + F + 4 rounded positive terms
    # (rows, micro-batches, the residual's F products, the scalings), so it is
    # within n eps; its squared norm within (2 n + F + 2) eps (F squares, the
    # division by the weight); the test's float32 jax.grad errs as much: x2.
    terms = batch_size + num + FEATURES_EXACT + 4
    norm_rtol = 2 * (2 * terms + FEATURES_EXACT + 2) * EPS
    # The estimators subtract nearly equal terms: the inputs' relative error
    # (plus the N + 4 roundings of S_b and of the formula) grows by the
    # conditioning, sum(|terms|) / |difference|; the noise scale adds both.
    input_rtol = norm_rtol + (num + 4) * EPS
    rtols = {
        "microbatch_grad_sq_norm": norm_rtol,
        "grad_sq_norm": norm_rtol,
        "small_batch": 0.0,  # whole numbers of rows, exact
        "big_batch": 0.0,
        "gradient_norm_sq": input_rtol * conditioning[0],
        "gradient_noise_trace": input_rtol * conditioning[1],
        "noise_scale": input_rtol * sum(conditioning) + EPS,
    }
    for field, rtol in rtols.items():
        chex.assert_trees_all_close(
            np.asarray(getattr(stats, field), np.float64),
            np.asarray(expected[field], np.float64),
            rtol=rtol,
            atol=0.0,
            custom_message=f"WindowStats.{field} (rtol {rtol:.3g})",
        )
    assert bool(stats.finite) and stats.microbatch_finite.shape == (num,)


EXACT_CASES = [
    ("mean", False),
    ("sum", False),
    ("sum", True),
    ("weighted", False),
    ("weighted", True),
]  # "mean" with pad is refused: unequal micro-batches have no common mean


@pytest.mark.parametrize(("reduction", "pad"), EXACT_CASES)
def test_window_stats_equal_those_of_the_micro_batches_mean_gradients(reduction, pad):
    batch_size = 30 if pad else 32  # 30 rows: micro-batches of 8, 8, 7 and 7
    w, x, y, mask = positive_data(batch_size)
    if reduction != "weighted":
        mask = jnp.ones(batch_size, bool)
    loss, batch = {
        "mean": (mean_of_squares, (x, y)),
        "sum": (sum_of_squares, (x, y)),
        "weighted": (weighted_squares, (x, y, mask)),
    }[reduction]
    step = jaxaccum.value_and_grad(
        loss,
        NUM_EXACT,
        batch_argnums=tuple(range(1, 1 + len(batch))),
        reduction=reduction,
        pad=pad,
        report_stats=True,
    )
    _, stats = jax.jit(step)(w, *batch)
    expected, conditioning = reference_stats(w, x, y, mask, NUM_EXACT)
    assert_stats_match(stats, expected, conditioning, batch_size, NUM_EXACT)


def test_sum_loss_stats_equal_the_mean_loss_stats_on_the_same_data():
    w, x, y, _ = positive_data(32)

    def stats_of(loss, reduction):
        step = jaxaccum.value_and_grad(
            loss,
            NUM_EXACT,
            batch_argnums=(1, 2),
            reduction=reduction,
            report_stats=True,
        )
        return jax.jit(step)(w, x, y)[1]

    mean_stats = stats_of(mean_of_squares, "mean")
    sum_stats = stats_of(sum_of_squares, "sum")
    # Both are within the bound of the exact figures; the float64 mean stats
    # stand in for them, with the conditioning of the exact figures.
    _, conditioning = reference_stats(w, x, y, jnp.ones(32, bool), NUM_EXACT)
    expected = {
        field: np.asarray(v, np.float64) for field, v in mean_stats._asdict().items()
    }
    assert_stats_match(sum_stats, expected, conditioning, 32, NUM_EXACT)


def test_complex_parameters_count_their_imaginary_parts():
    _, x, y, _ = positive_data(32)
    # Real and imaginary residuals both positive: sums without cancellation.
    w = jnp.full(FEATURES_EXACT, 1 + 1j, jnp.complex64)

    def loss(w, x, y):
        return 0.5 * jnp.mean(jnp.abs(x @ w - y) ** 2)

    step = jaxaccum.value_and_grad(
        loss, NUM_EXACT, batch_argnums=(1, 2), report_stats=True
    )
    optimizer = jaxaccum.MultiSteps(
        optax.sgd(0.1),
        NUM_EXACT,
        track_noise_scale=True,
    )
    state = optimizer.init(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complex-to-real cast warns
        (_, grads), stats = jax.jit(step)(w, x, y)
        micro_grads = [
            jax.grad(loss)(w, x[k::NUM_EXACT], y[k::NUM_EXACT])
            for k in range(NUM_EXACT)
        ]
        for micro_grad in micro_grads:
            _, state = jax.jit(optimizer.update)(micro_grad, state, w)
    assert grads.dtype == jnp.complex64

    def sq_norm(tree):
        leaves = jax.tree.leaves(tree)
        return sum(np.sum(np.abs(np.asarray(g, np.complex128)) ** 2) for g in leaves)

    # The returned gradient's own norm: 2F rounded squares summed, |S|^2 / N^2
    # against |S / N|^2 (one rounding per entry): (2F + 6) eps.
    chex.assert_trees_all_close(
        stats.grad_sq_norm, sq_norm(grads), rtol=(2 * FEATURES_EXACT + 6) * EPS
    )
    # Against the test's jax.grad: positive terms as in assert_stats_match,
    # with 2F squares (real and imaginary parts) in each norm.
    terms = 32 + NUM_EXACT + FEATURES_EXACT + 4
    rtol = 2 * (2 * terms + 2 * FEATURES_EXACT + 2) * EPS
    mean_grad = sum(np.asarray(g, np.complex128) for g in micro_grads) / NUM_EXACT
    micro_sq = [sq_norm(g) for g in micro_grads]
    chex.assert_trees_all_close(
        (stats.microbatch_grad_sq_norm, stats.grad_sq_norm),
        (np.array(micro_sq), sq_norm(mean_grad)),
        rtol=rtol,
    )
    # MultiSteps (weight 1 per call): sum_k |g_k|^2 and |mean_k g_k|^2.
    chex.assert_trees_all_close(
        (state.noise.sq_norm_sum, state.noise.window_sq_norm),
        (sum(micro_sq), sq_norm(mean_grad)),
        rtol=rtol,
    )
    real_parts_only = np.sum(np.real(np.asarray(grads, np.complex128)) ** 2)
    assert float(stats.grad_sq_norm) > 1.5 * real_parts_only, (
        f"imaginary parts dropped: {float(stats.grad_sq_norm)} vs {real_parts_only}"
    )


@pytest.mark.parametrize(
    ("half_life", "error", "message"),
    [
        (0.0, ValueError, r"half_life must be > 0.0, got 0.0"),
        (-64.0, ValueError, r"half_life must be > 0.0, got -64.0"),
        (np.inf, ValueError, r"half_life must be a finite number \(> 0.0\), got inf"),
        (1e300, ValueError, "half_life must be of magnitude .* infinite"),
        ("64", TypeError, "half_life must be a real scalar.*'64' of type str"),
        (np.full(2, 64.0), TypeError, r"half_life must be a real.*shape \(2,\)"),
    ],
)
def test_ema_half_life_errors_name_it(half_life, error, message):
    with pytest.raises(error, match=message):
        jaxaccum.growth.NoiseScaleEMA(half_life)


def test_ema_half_life_is_kept_as_a_python_float():
    """A 0-d NumPy or JAX half-life averages as the Python float does."""
    stats = Window(jnp.float32(48.0), jnp.float32(2.0), jnp.float32(8.0))
    states = []
    for half_life in (64.0, np.asarray(64.0), np.float32(64.0), jnp.float32(64.0)):
        ema = jaxaccum.growth.NoiseScaleEMA(half_life)
        assert type(ema.half_life) is float and ema.half_life == 64.0, ema
        states.append(ema.update(ema.update(ema.init(), stats), stats))
    for state in states[1:]:
        chex.assert_trees_all_equal(tuple(state), tuple(states[0]))
    with pytest.raises(TypeError, match="half_life must be a concrete number"):
        jax.jit(jaxaccum.growth.NoiseScaleEMA)(64.0)
