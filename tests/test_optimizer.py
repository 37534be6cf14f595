"""jaxaccum.MultiSteps / accumulate against one step of the wrapped optimizer.

The reference is the unwrapped optimizer called once per window on the
window's (weighted) mean gradient, averaged in float64 by numpy. Tolerances
(float32): RTOL, ATOL (tests/tolerances.py); jaxaccum sums in float32 and
divides once, so rounding is the only difference.
"""

import doctest
import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL

import jaxaccum
import jaxaccum._multisteps._multisteps

# Float32 rounding bounds, derived in tests/tolerances.py.
CALLS_PER_WINDOW = 3
NUM_WINDOWS = 3

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(0.1)),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.1, 0.01, transition_steps=2)
    ),
}


def make_params(dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(4, 3)), dtype),
        "b": jnp.asarray(rng.normal(size=(3,)), dtype),
    }


def make_windows(sizes, seed=1, dtype=jnp.float32) -> list[list[dict]]:
    """Random gradients shaped like `make_params`, grouped in windows."""
    rng = np.random.default_rng(seed)
    return [
        [
            {
                "w": jnp.asarray(rng.normal(size=(4, 3)), dtype),
                "b": jnp.asarray(rng.normal(size=(3,)), dtype),
            }
            for _ in range(size)
        ]
        for size in sizes
    ]


def weighted_mean(grads, weights=None):
    """The window's exact gradient, computed in float64 by numpy."""
    weights = np.ones(len(grads)) if weights is None else np.asarray(weights)
    total = weights.sum()
    return jax.tree.map(
        lambda *leaves: jnp.asarray(
            sum(
                w * np.asarray(g, np.float64)
                for w, g in zip(weights, leaves, strict=True)
            )
            / total,
            jnp.float32,
        ),
        *grads,
    )


def run_reference(opt, params, windows, weights=None):
    """One call of ``opt`` per window, on the window's weighted mean."""
    update = jax.jit(opt.update)
    state = opt.init(params)
    for i, window in enumerate(windows):
        mean = weighted_mean(window, None if weights is None else weights[i])
        updates, state = update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def run_accumulated(wrapper, params, windows, weights=None):
    """Calls ``wrapper`` once per gradient; checks zeros and has_updated."""
    update = jax.jit(wrapper.update)
    state = wrapper.init(params)
    for i, window in enumerate(windows):
        for j, grads in enumerate(window):
            extra = {} if weights is None else {"weight": weights[i][j]}
            updates, state = update(grads, state, params, **extra)
            emitting = j == len(window) - 1
            assert bool(wrapper.has_updated(state)) == emitting, (
                f"window {i} call {j}: has_updated should be {emitting}"
            )
            if not emitting:
                chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
            params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_k_calls_match_one_call_on_mean_gradient(name):
    opt = OPTIMIZERS[name]()
    params = make_params()
    windows = make_windows([CALLS_PER_WINDOW] * NUM_WINDOWS)

    wrapper = jaxaccum.MultiSteps(opt, CALLS_PER_WINDOW)
    got_params, got_state = run_accumulated(wrapper, params, windows)
    want_params, want_state = run_reference(opt, params, windows)

    chex.assert_trees_all_close(got_params, want_params, rtol=RTOL, atol=ATOL)
    # Count, schedule position, moments: the inner optimizer saw one step a window.
    chex.assert_trees_all_close(
        got_state.inner_opt_state, want_state, rtol=RTOL, atol=ATOL
    )
    assert int(got_state.gradient_step) == NUM_WINDOWS
    assert int(got_state.mini_step) == 0


def test_inner_update_runs_only_on_emitting_calls():
    calls = []

    def counted_update(updates, state, params=None, **extra_args):
        jax.debug.callback(lambda: calls.append(1))
        return optax.sgd(0.1).update(updates, state, params)

    inner = optax.GradientTransformationExtraArgs(optax.sgd(0.1).init, counted_update)
    params = make_params()
    windows = make_windows([4, 4])
    run_accumulated(jaxaccum.MultiSteps(inner, 4), params, windows)
    jax.effects_barrier()
    assert len(calls) == 2, f"inner update ran {len(calls)} times for 2 windows"


def test_clips_the_window_gradient_not_micro_gradients():
    # Micro-gradients 3v and -v have norms 1.5 and 0.5; their mean v has norm
    # 0.5 < 1, so it is not clipped. Clipping each micro-gradient would give
    # the mean (2v - v) / 2 = v / 2 instead.
    v = jnp.array([0.3, 0.4])
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    wrapper = jaxaccum.MultiSteps(opt, 2)
    params = {"v": jnp.zeros(2)}
    state = wrapper.init(params)
    _, state = wrapper.update({"v": 3 * v}, state, params)
    updates, _ = wrapper.update({"v": -v}, state, params)
    chex.assert_trees_all_close(updates, {"v": -v}, rtol=RTOL, atol=ATOL)


def test_callable_every_k_schedule():
    def every_k(gradient_step):
        return jnp.where(gradient_step < 2, 1, 3)

    opt = optax.adam(0.1)
    params = make_params()
    windows = make_windows([1, 1, 3, 3])
    got_params, got_state = run_accumulated(
        jaxaccum.MultiSteps(opt, every_k), params, windows
    )
    want_params, _ = run_reference(opt, params, windows)
    chex.assert_trees_all_close(got_params, want_params, rtol=RTOL, atol=ATOL)
    assert int(got_state.gradient_step) == 4


def test_matches_optax_multisteps():
    opt = optax.adam(0.1)
    ours = jaxaccum.MultiSteps(opt, 3, should_skip_update_fn=optax.skip_not_finite)
    theirs = optax.MultiSteps(opt, 3, should_skip_update_fn=optax.skip_not_finite)
    params = make_params()
    grads = [g for window in make_windows([7]) for g in window]
    grads[2] = jax.tree.map(lambda x: x.at[0].set(jnp.nan), grads[2])
    our_state, their_state = ours.init(params), theirs.init(params)
    for i, g in enumerate(grads):
        our_updates, our_state = jax.jit(ours.update)(g, our_state, params)
        their_updates, their_state = jax.jit(theirs.update)(g, their_state, params)
        chex.assert_trees_all_close(
            our_updates,
            their_updates,
            rtol=RTOL,
            atol=ATOL,
            custom_message=f"call {i}",
        )
        for field in ("mini_step", "gradient_step", "inner_opt_state", "skip_state"):
            chex.assert_trees_all_close(
                getattr(our_state, field),
                getattr(their_state, field),
                rtol=RTOL,
                atol=ATOL,
                custom_message=f"call {i}, {field}",
            )
        params = optax.apply_updates(params, our_updates)


@pytest.mark.parametrize(
    "skip_fn",
    [
        optax.skip_not_finite,
        functools.partial(optax.skip_large_updates, max_squared_norm=100.0),
    ],
    ids=["skip_not_finite", "skip_large_updates"],
)
@pytest.mark.parametrize("bad_value", [jnp.nan, jnp.inf])
def test_skipped_call_leaves_state_unchanged(skip_fn, bad_value):
    wrapper = jaxaccum.MultiSteps(optax.adam(0.1), 2, should_skip_update_fn=skip_fn)
    update = jax.jit(wrapper.update)
    params = make_params()
    ((good_1, good_2),) = make_windows([2])
    bad = jax.tree.map(lambda x: x.at[0].set(bad_value), good_1)

    state = wrapper.init(params)
    _, state = update(good_1, state, params)
    # A bad call mid-window, then at the position that would emit.
    for _ in range(2):
        updates, new_state = update(bad, state, params)
        chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
        assert bool(new_state.skip_state["should_skip"])
        chex.assert_trees_all_equal(
            new_state._replace(skip_state=()), state._replace(skip_state=())
        )
        state = new_state
    updates, state = update(good_2, state, params)
    assert bool(wrapper.has_updated(state))
    want, _ = optax.adam(0.1).update(
        weighted_mean([good_1, good_2]), optax.adam(0.1).init(params), params
    )
    chex.assert_trees_all_close(updates, want, rtol=RTOL, atol=ATOL)


def test_weighted_windows_emit_token_weighted_mean():
    opt = optax.adam(0.1)
    params = make_params()
    windows = make_windows([3, 3, 2])
    weights = [[3.0, 1.0, 0.5], [0.0, 2.0, 7.0], [5, 1]]
    got_params, got_state = run_accumulated(
        jaxaccum.MultiSteps(opt, lambda step: jnp.where(step < 2, 3, 2)),
        params,
        windows,
        weights,
    )
    want_params, want_state = run_reference(opt, params, windows, weights)
    chex.assert_trees_all_close(got_params, want_params, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(
        got_state.inner_opt_state, want_state, rtol=RTOL, atol=ATOL
    )


def test_weighted_sum_and_zero_total_weight():
    params = {"v": jnp.zeros(2)}
    g1, g2 = {"v": jnp.array([1.0, 2.0])}, {"v": jnp.array([3.0, -1.0])}

    summed = jaxaccum.MultiSteps(optax.sgd(1.0), 2, use_grad_mean=False)
    state = summed.init(params)
    _, state = summed.update(g1, state, params, weight=2.0)
    updates, _ = summed.update(g2, state, params, weight=jnp.float32(0.5))
    chex.assert_trees_all_close(
        updates, {"v": -(2 * g1["v"] + 0.5 * g2["v"])}, rtol=RTOL, atol=ATOL
    )

    # Every token masked: the window emits exact zeros, not NaN.
    mean = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    state = mean.init(params)
    _, state = mean.update(g1, state, params, weight=0)
    updates, state = mean.update(g2, state, params, weight=0)
    assert bool(mean.has_updated(state))
    chex.assert_trees_all_equal(updates, {"v": jnp.zeros(2)})


def test_accumulator_carries_the_emitted_updates_until_next_window_starts():
    wrapper = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    params = {"v": jnp.zeros(2)}
    state = wrapper.init(params)
    _, state = wrapper.update({"v": jnp.array([1.0, 2.0])}, state, params, weight=2)
    chex.assert_trees_all_equal(state.acc_grads, {"v": jnp.array([2.0, 4.0])})
    updates, state = wrapper.update(
        {"v": jnp.array([4.0, 0.0])}, state, params, weight=1
    )
    # Emitted: sgd(1.0) on the mean (6, 4) / 3. The sum's buffer now holds the
    # updates it carried out; the weight stays readable.
    assert bool(wrapper.has_updated(state))
    chex.assert_trees_all_close(updates, {"v": -jnp.array([2.0, 4.0 / 3.0])})
    chex.assert_trees_all_equal(state.acc_grads, updates)
    assert float(state.acc_weight) == 3.0
    _, state = wrapper.update({"v": jnp.array([1.0, 1.0])}, state, params, weight=5)
    chex.assert_trees_all_equal(state.acc_grads, {"v": jnp.array([5.0, 5.0])})
    assert float(state.acc_weight) == 5.0
    assert int(state.mini_step) == 1


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("param_dtype", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: d.__name__)
def test_dtypes_match_unwrapped_optimizer(param_dtype, grad_dtype):
    opt = optax.adam(0.1)
    wrapper = jaxaccum.MultiSteps(opt, 2)
    params = make_params(param_dtype)
    grads = [g for window in make_windows([3], dtype=grad_dtype) for g in window]
    dtypes = functools.partial(jax.tree.map, lambda x: jnp.asarray(x).dtype)

    opt_state, state = opt.init(params), wrapper.init(params)
    init_dtypes = dtypes(state)
    for i, g in enumerate(grads):
        want, opt_state = jax.jit(opt.update)(g, opt_state, params)
        got, state = jax.jit(wrapper.update)(g, state, params)
        assert dtypes(got) == dtypes(want), f"call {i}"
        assert dtypes(state) == init_dtypes, f"call {i}: state dtypes changed"
    assert dtypes(state.acc_grads) == {"b": jnp.float32, "w": jnp.float32}


def test_complex_gradients_keep_their_imaginary_parts():
    """The accumulator is the param's dtype promoted to float32: complex stays
    complex (a float32 accumulator would drop the imaginary parts)."""
    wrapper = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    params = {"v": jnp.zeros(2, jnp.complex64)}
    state = wrapper.init(params)
    assert state.acc_grads["v"].dtype == jnp.complex64
    grads = [jnp.array([1 + 2j, 3j], jnp.complex64), jnp.array([1j, 1], jnp.complex64)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complex-to-real cast warns
        for grad in grads:
            updates, state = wrapper.update({"v": grad}, state, params)
    # Halving a sum of two small integers' halves is exact in float32.
    chex.assert_trees_all_equal(updates, {"v": -(grads[0] + grads[1]) / 2})


def test_low_precision_gradients_accumulate_in_float32():
    # In bfloat16 256 + 1 rounds to 256, so a bfloat16 sum of 256, 1, 1, 2 is
    # 258 and its mean 64.5; the float32 sum gives 260 / 4 = 65.
    wrapper = jaxaccum.MultiSteps(optax.sgd(1.0), 4)
    params = {"v": jnp.zeros(1, jnp.bfloat16)}
    state = wrapper.init(params)
    for value in (256.0, 1.0, 1.0, 2.0):
        updates, state = wrapper.update(
            {"v": jnp.full(1, value, jnp.bfloat16)}, state, params
        )
    assert updates["v"].dtype == jnp.bfloat16
    assert float(updates["v"][0]) == -65.0, f"got {updates['v']}"


def test_extra_args_reach_inner_optimizer():
    opt = optax.polyak_sgd(max_learning_rate=10.0)
    wrapper = jaxaccum.MultiSteps(opt, 2)
    params = make_params()
    ((g1, g2),) = make_windows([2])
    state = wrapper.init(params)
    update = jax.jit(wrapper.update)
    _, state = update(g1, state, params, value=jnp.float32(0.5))
    updates, _ = update(g2, state, params, value=jnp.float32(2.0))
    # The emitting call's value is the one used.
    want, _ = opt.update(
        weighted_mean([g1, g2]), opt.init(params), params, value=jnp.float32(2.0)
    )
    chex.assert_trees_all_close(updates, want, rtol=RTOL, atol=ATOL)


def test_static_and_array_extra_args_with_lbfgs():
    target = make_params()

    def loss(params):
        return sum(
            jnp.sum((p - t) ** 2)
            for p, t in zip(
                jax.tree.leaves(params), jax.tree.leaves(target), strict=True
            )
        )

    opt = optax.lbfgs()
    wrapper = jaxaccum.MultiSteps(opt, 2)
    params = jax.tree.map(jnp.zeros_like, target)
    ref_params = params
    state, ref_state = wrapper.init(params), opt.init(params)
    update = jax.jit(functools.partial(wrapper.update, value_fn=loss))
    ref_update = jax.jit(functools.partial(opt.update, value_fn=loss))
    for _ in range(2):
        # Full-batch micro-gradients: the window mean is the gradient itself.
        for _ in range(2):
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = update(grads, state, params, value=value, grad=grads)
        params = optax.apply_updates(params, updates)
        value, grads = jax.value_and_grad(loss)(ref_params)
        ref_updates, ref_state = ref_update(
            grads, ref_state, ref_params, value=value, grad=grads
        )
        ref_params = optax.apply_updates(ref_params, ref_updates)
    chex.assert_trees_all_close(params, ref_params, rtol=RTOL, atol=ATOL)
    assert float(loss(params)) < 1e-3 * float(
        loss(jax.tree.map(jnp.zeros_like, target))
    )


def test_works_inside_lax_scan():
    wrapper = jaxaccum.MultiSteps(optax.adam(0.1), CALLS_PER_WINDOW)
    params = make_params()
    windows = make_windows([CALLS_PER_WINDOW] * 2)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *sum(windows, []))

    @jax.jit
    def train(params, stacked):
        def body(carry, grads):
            params, state = carry
            updates, state = wrapper.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, _), _ = jax.lax.scan(body, (params, wrapper.init(params)), stacked)
        return params

    want, _ = run_reference(optax.adam(0.1), params, windows)
    chex.assert_trees_all_close(train(params, stacked), want, rtol=RTOL, atol=ATOL)


def test_works_under_vmap():
    wrapper = jaxaccum.MultiSteps(optax.adam(0.1), 2)
    params = make_params()
    batched_params = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
    windows = [make_windows([2], seed=1)[0], make_windows([2], seed=2)[0]]

    update = jax.jit(jax.vmap(wrapper.update))
    state = jax.vmap(wrapper.init)(batched_params)
    for call in range(2):
        grads = jax.tree.map(lambda *g: jnp.stack(g), *(w[call] for w in windows))
        updates, state = update(grads, state, batched_params)
    got = optax.apply_updates(batched_params, updates)

    for i in range(2):
        p = jax.tree.map(lambda x, i=i: x[i], batched_params)
        want, _ = run_reference(optax.adam(0.1), p, [windows[i]])
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, i=i: x[i], got), want, rtol=RTOL, atol=ATOL
        )


def test_works_under_shard_map():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    wrapper = jaxaccum.MultiSteps(optax.adam(0.1), 2)
    params = make_params()
    windows = make_windows([2, 2])

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P())
    )
    def step(grads, state, params):
        grads = jax.lax.pmean(grads, "data")
        return wrapper.update(grads, state, params)

    state = wrapper.init(params)
    got = params
    for window in windows:
        for grads in window:
            updates, state = step(grads, state, got)
        got = optax.apply_updates(got, updates)
    want, _ = run_reference(optax.adam(0.1), params, windows)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_accumulate_is_the_functional_spelling():
    opt = optax.adamw(0.1, weight_decay=0.1)
    transform = jaxaccum.accumulate(opt, CALLS_PER_WINDOW)
    assert isinstance(transform, optax.GradientTransformationExtraArgs)
    params = make_params()
    windows = make_windows([CALLS_PER_WINDOW] * 2)

    state = transform.init(params)
    got = params
    for window in windows:
        for grads in window:
            updates, state = transform.update(grads, state, got)
        got = optax.apply_updates(got, updates)
    want, _ = run_reference(opt, params, windows)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_optax_api_surface():
    wrapper = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
    assert isinstance(
        wrapper.gradient_transformation(), optax.GradientTransformationExtraArgs
    )
    assert isinstance(wrapper.inner_opt, optax.GradientTransformationExtraArgs)
    assert jaxaccum.MultiStepsState._fields[:5] == optax.MultiStepsState._fields


@pytest.mark.parametrize(
    ("every_k", "error", "match"),
    [
        (0, ValueError, ">= 1"),
        (True, TypeError, "int or a function"),
        (2.0, TypeError, "int or a function"),
        (np.int64(-1), ValueError, ">= 1"),
    ],
)
def test_bad_every_k_is_rejected(every_k, error, match):
    with pytest.raises(error, match=match):
        jaxaccum.MultiSteps(optax.sgd(0.1), every_k)


def test_schedule_returning_float_is_rejected():
    wrapper = jaxaccum.MultiSteps(optax.sgd(0.1), lambda step: 2.0)
    params = make_params()
    with pytest.raises(TypeError, match="integer scalar"):
        wrapper.update(params, wrapper.init(params), params)


@pytest.mark.parametrize(
    ("weight", "error", "match"),
    [
        (jnp.ones(3), ValueError, r"shape \(3,\)"),
        ("7", TypeError, "scalar number"),
        (jnp.array(True), TypeError, "numeric"),
        # Issue 35, case 12: a negative weight emitted (3 g1 - g2) / 2.
        (-1.0, ValueError, "weight must be >= 0.0, got -1.0"),
        (
            np.float32(np.nan),
            ValueError,
            r"weight must be a finite number \(>= 0.0\), got nan",
        ),
        (jnp.inf, ValueError, r"weight must be a finite number \(>= 0.0\), got inf"),
    ],
)
def test_bad_weight_is_rejected(weight, error, match):
    wrapper = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
    params = make_params()
    with pytest.raises(error, match=match):
        wrapper.update(params, wrapper.init(params), params, weight=weight)


def test_traced_negative_weight_gives_no_plausible_update():
    """Under jit a weight cannot be checked: a negative one makes the
    window's update NaN (it emitted (3 g1 - g2) / 2 before)."""
    wrapper = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    params = make_params()
    update = jax.jit(wrapper.update)
    state = wrapper.init(params)
    _, state = update(params, state, params, weight=jnp.float32(1.0))
    updates, _ = update(params, state, params, weight=jnp.float32(-1.0))
    for leaf in jax.tree.leaves(updates):
        assert np.all(np.isnan(leaf)), leaf


@pytest.mark.parametrize("every_k", [2**40, np.int64(2**40)])
def test_window_length_beyond_int32_is_refused(every_k):
    """Issue 35: every_k=2**40 was an OverflowError from inside JAX."""
    params = make_params()
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
        jaxaccum.MultiSteps(optax.sgd(0.1), every_k)
    wrapper = jaxaccum.MultiSteps(optax.sgd(0.1), None)
    with pytest.raises(ValueError, match="every_k must be at most 2\\*\\*31 - 1"):
        wrapper.update(params, wrapper.init(params), params, every_k=every_k)


def test_bad_skip_function_is_rejected():
    def skip_fn(updates, gradient_step, params):
        return jnp.int32(0), ()

    wrapper = jaxaccum.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=skip_fn)
    params = make_params()
    with pytest.raises(ValueError, match="boolean scalar"):
        wrapper.update(params, wrapper.init(params), params)


def test_docstring_examples_run():
    failures, tried = doctest.testmod(jaxaccum._multisteps._multisteps)
    assert tried > 0
    assert failures == 0
