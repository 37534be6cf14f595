"""Growing the batch: the controllers and the learning rate that follows the batch.

The noise-scale controller runs on the population of noise_population.py,
whose B_noise = tr(Sigma) / |G|^2 is known exactly at any parameters.

Tolerances. The controllers' sizes are integers decided by comparisons, so
they are checked exactly. The learning-rate factors are a few float32
operations on exact inputs (powers of two, small integers), each correctly
rounded to within the unit roundoff u = 2**-24 (IEEE 754 for +, -, *, /,
sqrt), so a factor of k operations is within k u (relative) of its float64
value; the tests allow twice that.
"""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from noise_population import mean_loss, population, sample, truth

import jaxaccum
from jaxaccum import _growth
from jaxaccum._growth import (
    batch_ramp,
    batch_scale,
    noise_scale_batch,
    scale_by_batch_learning_rate,
)

UNIT_ROUNDOFF = 2.0**-24  # float32


class Totals(NamedTuple):
    """The scalars of a WindowStats that the controllers read."""

    big_batch: float
    gradient_norm_sq: float = float("nan")
    gradient_noise_trace: float = float("nan")


def expected_ramp_sizes(schedule, window_weights):
    """The ramp by hand: the value at the largest key <= examples seen."""
    seen, sizes = 0.0, []
    for weight in window_weights:
        sizes.append(schedule[max(k for k in schedule if k <= seen)])
        seen += weight(sizes[-1])
    return sizes, seen


@pytest.mark.parametrize(
    "weight",
    [lambda num: 8.0 * num, lambda num: 8.0 * num - 3.0],  # examples; tokens
    ids=["examples", "tokens"],
)
def test_batch_ramp_follows_its_schedule(weight):
    schedule = {0: 1, 16: 2, 48: 4, 100: 3, 160: 8}
    ramp = batch_ramp(8, schedule)
    state, sizes = ramp.init(), []
    for _ in range(12):
        sizes.append(ramp.num_microbatches(state))
        assert ramp.effective_batch_size(state) == 8 * sizes[-1]
        state = ramp.update(state, Totals(weight(sizes[-1])))
    expected, seen = expected_ramp_sizes(schedule, [weight] * 12)
    assert sizes == expected, f"ramp gave {sizes}, its schedule {expected}"
    assert float(state.examples_seen) == seen
    assert ramp.possible_num_microbatches == (1, 2, 3, 4, 8)


def test_batch_ramp_on_value_and_grad_hits_a_key_exactly():
    ramp = batch_ramp(4, {0: 1, 8: 2, 24: 4})
    x, y = population()
    update = jax.jit(ramp.update)
    state, sizes = ramp.init(), []
    for _ in range(5):
        num = ramp.num_microbatches(state)
        step = jaxaccum.value_and_grad(
            mean_loss, num, batch_argnums=(1, 2), report_stats=True
        )
        _, stats = step(jnp.ones(6), x[: 4 * num], y[: 4 * num])
        state = update(state, stats)
        sizes.append(num)
    # Examples seen: 4, 8 (= key 8: the next window has 2), 16, 24 (= key 24),
    # 40.
    assert sizes == [1, 1, 2, 2, 4], sizes
    assert float(state.examples_seen) == 40.0


def test_examples_seen_stays_exact_past_float32_integers():
    # Past 2**24 a plain float32 sum drops small windows: 2**26 + 3 rounds
    # back to 2**26 (spacing 8), so it would never move. Kahan's compensation
    # keeps the exact count, 2**26 + 3000, which float32 represents.
    ramp = batch_ramp(3, {0: 1, 2**26 + 2_000: 2})
    state = ramp.init()._replace(examples_seen=jnp.float32(2**26))
    update = jax.jit(ramp.update)
    for _ in range(1000):
        state = update(state, Totals(3.0))
    assert float(state.examples_seen) == 2**26 + 3000
    assert ramp.num_microbatches(state) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"microbatch_size": 0, "schedule": {0: 1}}, "microbatch_size must be >= 1"),
        ({"microbatch_size": 8, "schedule": {}}, "schedule is empty"),
        ({"microbatch_size": 8, "schedule": {10: 1}}, "start at 0 examples.*10"),
        ({"microbatch_size": 8, "schedule": {0: 1, 5: 0}}, r"schedule\[5\].*got 0"),
        ({"microbatch_size": 8, "schedule": {0: 1, -5: 2}}, "start at 0.*-5"),
    ],
)
def test_batch_ramp_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        batch_ramp(**kwargs)


def test_batch_ramp_rejects_non_integer_sizes():
    with pytest.raises(TypeError, match=r"schedule\[0\].*2.5"):
        batch_ramp(8, {0: 2.5})
    with pytest.raises(TypeError, match="microbatch_size.*float"):
        batch_ramp(8.0, {0: 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_microbatches": 1}, "min_microbatches must be >= 2, got 1"),
        ({"max_microbatches": 2, "min_microbatches": 4}, r"max_microbatches \(2\)"),
        ({"microbatch_size": -1}, "microbatch_size must be >= 1, got -1"),
        ({"kappa": 0.0}, "kappa must be a positive number, got 0.0"),
        ({"decay": 1.0}, r"decay must be in \[0, 1\), got 1.0"),
        ({"warmup_windows": 0}, "warmup_windows must be >= 1, got 0"),
    ],
)
def test_noise_scale_batch_rejects_bad_arguments(kwargs, message):
    arguments = {"microbatch_size": 8, "max_microbatches": 64} | kwargs
    with pytest.raises(ValueError, match=message):
        noise_scale_batch(**arguments)


def run_controller(controller, state, windows):
    """Sizes, and the state after, for a list of per-window Totals makers."""
    sizes = []
    for window in windows:
        sizes.append(controller.num_microbatches(state))
        state = controller.update(state, window(sizes[-1]))
    return sizes, state


def noisy(num):
    """A window whose |G|^2 average is 0: an infinite noise scale."""
    return Totals(8.0 * num, 0.0, 1.0)


def test_noise_scale_batch_grows_on_schedule_and_clamps_at_max():
    controller = noise_scale_batch(
        8, 12, warmup_windows=3, min_windows_between_changes=4
    )
    assert controller.possible_num_microbatches == (2, 4, 8, 12)
    nan = lambda num: Totals(8.0 * num)  # noqa: E731  one micro-batch: NaN
    windows = [nan] * 5 + [noisy] * 20
    sizes, state = run_controller(controller, controller.init(), windows)
    # Warm-up counts the 3 windows with finite estimates (windows 5-7), so the
    # first doubling follows window 7; then one every 4 windows, up to 12.
    assert sizes == [2] * 8 + [4] * 4 + [8] * 4 + [12] * 9, sizes
    assert int(state.noise.num_windows) == 20


def test_noise_scale_batch_doubles_exactly_at_its_threshold():
    # decay=0: the averages are the last window's, so the threshold is exact.
    controller = noise_scale_batch(
        8, 64, decay=0.0, warmup_windows=1, min_windows_between_changes=1
    )

    def noise_scale(b_noise):  # |G|^2 = 1, so B_noise = tr(Sigma)
        return lambda num: Totals(8.0 * num, 1.0, b_noise)

    # 2 micro-batches of 8 double to 4 once kappa B_noise >= 2 * 16, and 4
    # double to 8 once it reaches 64; a hair below stays.
    windows = [noise_scale(b) for b in (31.9, 31.9, 32.0, 63.9, 63.9, 64.0, 1.0)]
    sizes, _ = run_controller(controller, controller.init(), windows)
    assert sizes == [2, 2, 2, 4, 4, 4, 8], sizes


@functools.cache
def population_window(num, microbatch_size, scale):
    """A jitted window of ``num`` micro-batches drawn from the population at
    ``scale`` times the least-squares parameters."""
    x, y = population()
    params = scale * jnp.linalg.lstsq(x, y)[0]
    step = jaxaccum.value_and_grad(
        mean_loss, num, batch_argnums=(1, 2), report_stats=True
    )

    @jax.jit
    def window(key):
        return step(params, *sample(key, x, y, num * microbatch_size, "mean"))[1]

    return window, params


def test_noise_scale_batch_settles_near_the_known_noise_scale():
    microbatch_size, scale, windows = 8, 0.97, 600
    params = population_window(2, microbatch_size, scale)[1]
    norm_sq, trace = truth(params, *population())
    b_noise = trace / norm_sq  # 170.5 examples
    controller = noise_scale_batch(microbatch_size, 64)
    state, sizes = controller.init(), []
    compiled = _growth._noise_scale_update._cache_size()
    for key in jax.random.split(jax.random.key(7), windows):
        sizes.append(controller.num_microbatches(state))
        window = population_window(sizes[-1], microbatch_size, scale)[0]
        state = controller.update(state, window(key))
    changes = [i for i in range(1, windows) if sizes[i] != sizes[i - 1]]
    summary = f"sizes change at windows {changes} to {[sizes[i] for i in changes]}"
    assert _growth._noise_scale_update._cache_size() == compiled + 1, (
        f"update compiled {_growth._noise_scale_update._cache_size() - compiled} "
        f"times for windows of {sorted(set(sizes))} micro-batches"
    )
    assert sizes[0] == 2 and sizes == sorted(sizes), f"shrank: {summary}"
    gaps = np.diff([0, *changes])
    assert gaps.min() >= 50, f"changes closer than 50 windows: {summary}"
    settled = sizes[-1] * microbatch_size
    assert b_noise / 2 <= settled <= 2 * b_noise, (
        f"settled at {settled} examples, B_noise {b_noise:.1f}; {summary}"
    )
    estimated = float(controller.noise_scale(state))
    assert b_noise / 2 <= estimated <= 2 * b_noise, (estimated, b_noise)


def checkpoint_round_trip(path, state):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    return checkpointer.restore(path, jax.tree.map(jnp.zeros_like, state))


def random_windows(count):
    rng = np.random.default_rng(0)
    return [
        lambda num, n=n, t=t: Totals(8.0 * num - 1.0, n, t)
        for n, t in zip(
            rng.normal(1.0, 1.0, count), rng.gamma(40.0, size=count), strict=True
        )
    ]


@pytest.mark.parametrize("kind", ["ramp", "noise"])
def test_states_survive_an_orbax_round_trip_mid_run(tmp_path, kind):
    if kind == "ramp":
        controller = batch_ramp(8, {0: 2, 100: 4, 300: 8})
    else:
        controller = noise_scale_batch(
            8, 64, warmup_windows=3, min_windows_between_changes=3
        )
    windows = random_windows(40)
    through, through_state = run_controller(controller, controller.init(), windows)
    first, middle = run_controller(controller, controller.init(), windows[:17])
    restored = checkpoint_round_trip(tmp_path / kind, middle)
    chex.assert_trees_all_equal(restored, middle)
    chex.assert_trees_all_equal_dtypes(restored, middle)
    second, after = run_controller(controller, restored, windows[17:])
    assert first + second == through and len(set(through)) > 1, through
    chex.assert_trees_all_equal(after, through_state)


def test_update_jits_once_across_window_sizes():
    ramp = batch_ramp(4, {0: 1, 8: 2, 24: 4})
    controller = noise_scale_batch(
        4, 8, warmup_windows=1, min_windows_between_changes=1
    )
    x, y = population()
    ramp_update = jax.jit(chex.assert_max_traces(ramp.update, n=1))
    noise_update = jax.jit(chex.assert_max_traces(controller.update, n=1))
    ramp_state, noise_state = ramp.init(), controller.init()
    for num in (1, 2, 4, 2, 8):
        stats = jaxaccum.value_and_grad(
            mean_loss, num, batch_argnums=(1, 2), report_stats=True
        )(jnp.ones(6), x[: 4 * num], y[: 4 * num])[1]
        totals = Totals(
            stats.big_batch, stats.gradient_norm_sq, stats.gradient_noise_trace
        )
        totals = jax.tree.map(jnp.float32, totals)
        ramp_state = ramp_update(ramp_state, totals)
        noise_state = noise_update(noise_state, totals)
    assert ramp_update._cache_size() == noise_update._cache_size() == 1


# Learning-rate rules. base_batch and the batches are powers of two, so the
# ratio S is exact; "linear" is then exact and "sqrt" one rounding from
# sqrt(S) (and sqrt(2 S) / sqrt(S) two roundings from sqrt(2)).
@pytest.mark.parametrize(
    ("rule", "ratio"), [("linear", 2.0), ("sqrt", np.sqrt(2.0)), ("none", 1.0)]
)
def test_rules_scale_the_learning_rate_when_the_batch_doubles(rule, ratio):
    for batch in (32, 64, 256):
        doubled = batch_scale(rule, 2 * batch, 64) / batch_scale(rule, batch, 64)
        np.testing.assert_allclose(doubled, ratio, rtol=2 * 3 * UNIT_ROUNDOFF)
    assert float(batch_scale(rule, 64, 64)) == 1.0


def adascale_gain_float64(norm_sq, trace, batch, base):
    scale = batch / base
    variance = trace / base
    return (variance + norm_sq) / (variance / scale + norm_sq)


@pytest.mark.parametrize(
    ("norm_sq", "trace"), [(1.0, 256.0), (4.0, 3.0), (0.5, 1000.0), (10.0, 0.25)]
)
@pytest.mark.parametrize("batch", [128, 256, 1024])
def test_adascale_gain_is_the_formula_and_between_1_and_s(norm_sq, trace, batch):
    base = 64
    gain = float(batch_scale("adascale", batch, base, norm_sq, trace))
    # Six float32 operations on exact inputs: within 6 u of the float64 value.
    expected = adascale_gain_float64(norm_sq, trace, batch, base)
    np.testing.assert_allclose(gain, expected, rtol=2 * 6 * UNIT_ROUNDOFF)
    assert 1.0 <= gain <= batch / base


@pytest.mark.parametrize(
    ("norm_sq", "trace", "expected"),
    [
        (0.0, 5.0, 4.0),  # noise only: S
        (-1.0, 5.0, 4.0),  # an average |G|^2 below 0 is noise only too
        (3.0, 0.0, 1.0),  # no noise: 1
        (float("nan"), 5.0, 1.0),  # no estimate yet: 1
        (0.0, 0.0, 1.0),
    ],
)
def test_adascale_gain_limits(norm_sq, trace, expected):
    assert float(batch_scale("adascale", 256, 64, norm_sq, trace)) == expected


def test_schedule_is_indexed_by_examples_seen():
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4096)
    optimizer = scale_by_batch_learning_rate(schedule, base_batch=64, rule="none")
    update = jax.jit(chex.assert_max_traces(optimizer.update, n=1))

    def rates(batch_size, windows):
        state, seen_rates = optimizer.init(jnp.zeros(2)), {}
        for _ in range(windows):
            seen = float(state.examples_seen)
            _, state = update(jnp.ones(2), state, batch_size=jnp.float32(batch_size))
            seen_rates[seen] = float(state.learning_rate)
        return seen_rates

    small, large = rates(32, 64), rates(128, 16)
    common = sorted(set(small) & set(large))
    assert len(common) == 16
    # The same float32 examples_seen into the same schedule: bitwise equal.
    assert [small[s] for s in common] == [large[s] for s in common]
    assert large[1024.0] == float(schedule(1024.0))


def test_transform_scales_updates_and_follows_the_batch_without_retracing():
    optimizer = optax.chain(
        optax.sgd(1.0),  # the descent direction; the rate comes from ours
        scale_by_batch_learning_rate(
            0.5, base_batch=64, rule="linear", flip_sign=False
        ),
    )
    update = jax.jit(chex.assert_max_traces(optimizer.update, n=1))
    state = optimizer.init(jnp.zeros(2))
    for batch, expected in ((64, 0.5), (128, 1.0), (512, 4.0)):
        updates, state = update(jnp.ones(2), state, batch_size=jnp.float32(batch))
        np.testing.assert_array_equal(updates, -expected * jnp.ones(2))


def test_adascale_transform_averages_the_window_estimates():
    decay = 0.5
    optimizer = scale_by_batch_learning_rate(
        2.0, base_batch=64, rule="adascale", noise_decay=decay
    )
    state = optimizer.init(jnp.zeros(2))
    windows = [(1.0, 64.0), (3.0, 320.0)]
    for norm_sq, trace in windows:
        stats = Totals(256.0, norm_sq, trace)
        _, state = optimizer.update(
            jnp.ones(2), state, batch_size=stats.big_batch, noise_estimates=stats
        )
    # Bias-corrected EMAs: (0.25 * 1 + 0.5 * 3) / 0.75 and likewise.
    norm_sq = (decay * (1 - decay) * 1.0 + (1 - decay) * 3.0) / (1 - decay**2)
    trace = (decay * (1 - decay) * 64.0 + (1 - decay) * 320.0) / (1 - decay**2)
    expected = 2.0 * adascale_gain_float64(norm_sq, trace, 256, 64)
    # The EMA and its correction add ~8 roundings to the gain's 6.
    np.testing.assert_allclose(
        state.learning_rate, expected, rtol=2 * 14 * UNIT_ROUNDOFF
    )


def test_transform_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="rule must be one of"):
        scale_by_batch_learning_rate(0.1, 64, rule="cubic")
    with pytest.raises(ValueError, match="base_batch must be a positive number"):
        scale_by_batch_learning_rate(0.1, 0)
    optimizer = scale_by_batch_learning_rate(0.1, 64, rule="adascale")
    state = optimizer.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="batch_size=stats.big_batch"):
        optimizer.update(jnp.ones(2), state)
    with pytest.raises(ValueError, match="noise_estimates=stats"):
        optimizer.update(jnp.ones(2), state, batch_size=64.0)
