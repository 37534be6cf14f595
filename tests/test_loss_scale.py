"""A float16 loss scale held for the window (issue #38).

Both paths: in one step (``value_and_grad(..., loss_scale=True)``, the state
passed per call, a :class:`jaxaccum.LossScaleReport` back) and across calls
(``MultiSteps(..., loss_scale=...)``). Claims: the unscaled float16 gradient
is the float32 big batch's (where the unscaled float16 one underflows); a
window with one overflowing micro-batch is skipped whole, parameters and
optimizer state bitwise unchanged; the scale backs off, grows after
``period`` finite windows (not micro-batches) and stops at its floor; a
MultiSteps window resumes bitwise from an orbax checkpoint; the option matrix
(front ends, reductions, N, aux, report_stats) gives the full batch's results
under a scale; and on 8 devices an overflow in any device's rows makes the
window not finite on all of them.

The float16 tolerance, derived (the model of ``f16_loss``: ``z = tanh(x
W1)``, ``out = z w2``, loss ``c mean(out)``, all float16 but the loss). With
the scale the backward pass stays in float16's normal range, so each
operation rounds by at most ``u = 2**-11`` relative. A per-example gradient
term (``c / B x_if w2_j (1 - z_ij**2)`` for ``W1``, ``c / B z_ij`` for
``w2``) inherits the forward pass's error, ``F u A_ij`` in ``x W1`` (``A_ij
= sum_f |x_if W1_fj|``; ``tanh`` and its derivative are 1-Lipschitz), and a
few roundings of its own: within ``(F + 8) u (1 + A_ij)`` times its scale
``s_i`` (``c / B |x_if w2_j|``, ``c / B``). A micro-batch sums ``b = B / N``
terms in float16 (``(b - 1) u sum s_i``); the float32 unscale (a power of
two), sum and mean add float32 roundings; the result is rounded to float16
(``u |g|``, or half its subnormal spacing, ``2**-25``, below ``2**-14``).
So ``|g - g_ref| <= K (F + b + 8) u sum_i s_i (1 + A_ij) + u |g_ref| +
2**-25``, ``K = 2`` for second-order terms, plus the float32 reference's
own bound (tolerances.py's, times the same scale). A micro-batch lost (a
quarter of the gradient at N = 4) or an underflowed term exceeds it.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from option_matrix import (
    CORE_PATHS,
    PER_MICROBATCH_AUX,
    SHARD_PATHS,
    build,
    cases,
    check_outcome,
    inputs,
    make_data,
    unpack,
)
from tolerances import ATOL, RTOL, UNIT_ROUNDOFF

import jaxaccum

F16_ROUNDOFF = 2.0**-11
F16_HALF_SUBNORMAL = 2.0**-25  # half the spacing of float16 below 2**-14
SECOND_ORDER = 2  # K in the module docstring
FEATURES, HIDDEN, BATCH = 4, 8, 64
# c: the loss is this small, so that float16's backward pass underflows
# unscaled (the hidden layer's cotangents fall below 2**-25).
LOSS_WEIGHT = 2.0**-10
OVERFLOW = 2.0**30  # a per-example weight that overflows float16's backward


# --- The float16 model ----------------------------------------------------------


def f16_params(dtype=jnp.float16, seed=0) -> dict:
    """Parameters on a grid exact in float16: ``W1`` small, ``w2`` tiny."""
    rng = np.random.default_rng(seed)
    return {
        "W1": jnp.asarray(rng.integers(-8, 8, (FEATURES, HIDDEN)) / 8 * 2**-13, dtype),
        "w2": jnp.asarray(rng.integers(-8, 8, HIDDEN) / 8 * 2**-12, dtype),
    }


def f16_batch(batch_size=BATCH, seed=1, overflow_row=None) -> dict:
    """Inputs large and exact in float16; ``boost`` weighs each example (1,
    or :data:`OVERFLOW` on ``overflow_row``)."""
    rng = np.random.default_rng(seed)
    boost = np.ones(batch_size, np.float32)
    if overflow_row is not None:
        boost[overflow_row] = OVERFLOW
    return {
        "x": jnp.asarray(rng.integers(-8, 8, (batch_size, FEATURES)) / 8 * 2**12),
        "boost": jnp.asarray(boost),
    }


def f16_loss(params: dict, batch: dict) -> jax.Array:
    """Float16 parameters and activations; the mean in float32."""
    z = jnp.tanh(batch["x"].astype(params["W1"].dtype) @ params["W1"])
    out = (z @ params["w2"]).astype(jnp.float32)
    return LOSS_WEIGHT * jnp.mean(batch["boost"] * out)


def f16_tolerance(params: dict, batch: dict, reference: dict, num: int) -> dict:
    """The module docstring's bound, per element."""
    x = np.asarray(batch["x"], np.float64)
    w1 = np.asarray(params["W1"], np.float64)
    w2 = np.asarray(params["w2"], np.float64)
    spread = 1 + np.abs(x) @ np.abs(w1)  # 1 + A_ij, (B, H)
    size = len(x)
    per_w1 = LOSS_WEIGHT / size * np.abs(x)[:, :, None] * np.abs(w2) * spread[:, None]
    scales = {"W1": per_w1.sum(0), "w2": (LOSS_WEIGHT / size * spread).sum(0)}
    units = SECOND_ORDER * (FEATURES + size // num + 8) * F16_ROUNDOFF
    reference_units = 2 * (size + FEATURES + 8) * UNIT_ROUNDOFF
    return {
        name: (units + reference_units) * scale
        + F16_ROUNDOFF * np.abs(np.asarray(reference[name], np.float64))
        + F16_HALF_SUBNORMAL
        for name, scale in scales.items()
    }


def assert_within(name: str, got, want, tolerance) -> None:
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert np.all(error <= tolerance), (
        f"{name}: error {error[worst]:.3g} > tolerance {tolerance[worst]:.3g} at "
        f"{worst} (gradient {np.asarray(want)[worst]:.3g})"
    )


@pytest.mark.parametrize("num", [2, 4])
def test_float16_window_matches_float32_big_batch(num):
    params, batch = f16_params(), f16_batch()
    reference = jax.grad(f16_loss)(f16_params(jnp.float32), batch)
    tolerance = f16_tolerance(params, batch, reference, num)
    step = jax.jit(jaxaccum.grad(f16_loss, num, loss_scale=True))
    grads, report = step(params, batch, loss_scale=jaxaccum.dynamic_loss_scale())
    assert bool(report.finite)
    for name in ("W1", "w2"):
        assert grads[name].dtype == jnp.float16, grads[name].dtype
        assert_within(f"grads[{name!r}]", grads[name], reference[name], tolerance[name])

    # Controls: unscaled, the hidden layer's gradient underflows to zero; one
    # micro-batch of N lost is outside the bound too.
    unscaled = jax.jit(jaxaccum.grad(f16_loss, num))(params, batch)
    assert not np.any(np.asarray(unscaled["W1"])), unscaled["W1"]
    with pytest.raises(AssertionError, match="W1"):
        assert_within("W1", unscaled["W1"], reference["W1"], tolerance["W1"])
    lost = jax.tree.map(lambda g: g * (num - 1) / num, grads)
    with pytest.raises(AssertionError, match="W1"):
        assert_within("W1", lost["W1"], reference["W1"], tolerance["W1"])


# --- One step: an overflowing micro-batch skips the whole window -------------------


def _train_step(accumulated, optimizer):
    @jax.jit
    def train_step(params, opt_state, scale, batch):
        (_, grads), report = accumulated(params, batch, loss_scale=scale)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jaxaccum.select_if_finite(
            report.finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, report

    return train_step


@pytest.mark.parametrize("front_end", ["value_and_grad", "shard_fsdp"])
def test_overflowing_micro_batch_skips_the_whole_window_bitwise(front_end):
    num, bad_row = 4, 6  # example 6 is in micro-batch 6 mod 4 = 2
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    params = f16_params()
    if front_end == "value_and_grad":
        accumulated = jaxaccum.value_and_grad(f16_loss, num, loss_scale=True)
    else:  # W1 sharded over the data axis: its gradient is checked per shard
        mesh = jax.make_mesh((1,), ("data",))
        accumulated = jaxaccum.shard_value_and_grad(
            f16_loss, num, mesh=mesh, loss_scale=True
        )
        specs = {"W1": P("data"), "w2": P()}
        params = {
            name: jax.device_put(leaf, NamedSharding(mesh, specs[name]))
            for name, leaf in params.items()
        }
    train_step = _train_step(accumulated, optimizer)
    opt_state = optimizer.init(params)
    scale = jaxaccum.dynamic_loss_scale(2.0**14, period=3)
    new_params, new_opt_state, report = train_step(
        params, opt_state, scale, f16_batch(overflow_row=bad_row)
    )
    assert not bool(report.finite)
    chex.assert_trees_all_equal(new_params, params, strict=True)
    chex.assert_trees_all_equal(new_opt_state, opt_state, strict=True)
    assert float(report.loss_scale.loss_scale) == 2.0**13  # backed off
    assert int(report.loss_scale.counter) == 0
    # Control: the same window without the overflow is applied.
    new_params, new_opt_state, report = train_step(
        params, opt_state, scale, f16_batch()
    )
    assert bool(report.finite)
    assert int(new_opt_state[0].count) == 1
    assert not np.array_equal(new_params["W1"], params["W1"])
    assert float(report.loss_scale.loss_scale) == 2.0**14
    assert int(report.loss_scale.counter) == 1


def test_report_finite_names_the_overflowing_micro_batch():
    step = jax.jit(
        jaxaccum.value_and_grad(f16_loss, 4, loss_scale=True, report_finite=True)
    )
    _, report = step(
        f16_params(),
        f16_batch(overflow_row=6),
        loss_scale=jaxaccum.dynamic_loss_scale(),
    )
    assert not bool(report.finite)
    np.testing.assert_array_equal(report.report.microbatch_finite, [1, 1, 0, 1])


# --- Across calls: MultiSteps -------------------------------------------------------

CALLS = 3  # per window


def call_grads(call: int, bad: bool = False) -> dict:
    """Call ``call``'s (unscaled) gradient; ``bad``: one element infinite,
    as a float16 backward pass that overflowed gives."""
    rng = np.random.default_rng(100 + call)
    grads = {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    if bad:
        grads["w"] = grads["w"].at[1, 2].set(jnp.inf)
    return grads


def multi_params() -> dict:
    return jax.tree.map(lambda g: g / 2, call_grads(-1))


def multisteps(**kwargs) -> jaxaccum.MultiSteps:
    return jaxaccum.MultiSteps(
        optax.adam(0.1),
        CALLS,
        loss_scale=jaxaccum.dynamic_loss_scale(
            2.0**10, period=2, min_loss_scale=2.0**8
        ),
        **kwargs,
    )


@functools.cache
def multi_step(**kwargs):
    optimizer = multisteps(**kwargs)

    @jax.jit
    def step(params, opt_state, call, bad):
        scale = optimizer.loss_scale(opt_state)
        grads = jax.tree.map(lambda g: g * scale, call_grads_traced(call, bad))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return optimizer, step


def call_grads_traced(call, bad):
    """:func:`call_grads` inside jit: the call's gradients stacked ahead of time."""
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *(call_grads(c) for c in range(12)))
    grads = jax.tree.map(lambda g: g[call], stacked)
    grads["w"] = jnp.where(bad, grads["w"].at[1, 2].set(jnp.inf), grads["w"])
    return grads


def run_multi(step, params, opt_state, calls, bad_calls=()):
    for call in calls:
        params, opt_state = step(params, opt_state, jnp.int32(call), call in bad_calls)
    return params, opt_state


@pytest.mark.parametrize(
    "skip_fn", [None, optax.skip_not_finite], ids=["no_skip_fn", "skip_not_finite"]
)
def test_multisteps_skips_a_window_with_an_overflowing_call_whole(skip_fn):
    optimizer, step = multi_step(should_skip_update_fn=skip_fn)
    params = multi_params()
    params, state = run_multi(step, params, optimizer.init(params), range(3))
    assert bool(optimizer.has_updated(state))
    before = (params, state.inner_opt_state)

    # Window 1: its middle call overflows (skip_not_finite would drop that
    # call alone and keep accumulating; with a scale the window is skipped).
    params, state = run_multi(step, params, state, range(3, 6), bad_calls={4})
    assert not bool(optimizer.has_updated(state))
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 1
    chex.assert_trees_all_equal((params, state.inner_opt_state), before, strict=True)
    assert float(optimizer.loss_scale(state)) == 2.0**9

    # Window 2 starts from an empty accumulator: one Adam step on its mean.
    params, state = run_multi(step, params, state, range(6, 9))
    assert bool(optimizer.has_updated(state))
    adam = optax.adam(0.1)
    reference, adam_state = multi_params(), adam.init(multi_params())
    for window in (range(3), range(6, 9)):
        mean = jax.tree.map(lambda *g: sum(g) / CALLS, *(call_grads(c) for c in window))
        updates, adam_state = adam.update(mean, adam_state, reference)
        reference = optax.apply_updates(reference, updates)
    chex.assert_trees_all_close(params, reference, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(state.inner_opt_state, adam_state, rtol=RTOL, atol=ATOL)


def test_accumulate_skips_a_window_with_a_weight_that_is_not_finite():
    """A traced weight cannot be checked: NaN marks the window (skipped,
    scale backed off) instead of emitting NaN updates."""
    transform = jaxaccum.accumulate(
        optax.sgd(0.1), 2, loss_scale=jaxaccum.dynamic_loss_scale(2.0**4)
    )
    update = jax.jit(transform.update)
    params = multi_params()
    state = transform.init(params)
    for call, weight in enumerate((1.0, jnp.nan)):
        grads = jax.tree.map(lambda g: g * 2.0**4, call_grads(call))
        updates, state = update(grads, state, params, weight=jnp.float32(weight))
    chex.assert_trees_all_equal(updates, optax.tree.zeros_like(updates))
    assert int(state.gradient_step) == 0 and int(state.mini_step) == 0
    assert float(state.loss_scale.scale.loss_scale) == 2.0**3


def test_without_a_scale_skip_not_finite_drops_the_call_not_the_window():
    """The documented difference: optax's per-call meaning is kept."""
    optimizer = jaxaccum.MultiSteps(
        optax.adam(0.1), CALLS, should_skip_update_fn=optax.skip_not_finite
    )
    params = multi_params()
    state = optimizer.init(params)
    for call in range(3):
        _, state = optimizer.update(call_grads(call, bad=call == 1), state, params)
    assert int(state.mini_step) == 2, "the bad call was dropped, the window goes on"


# --- The scale's trajectory, both paths ----------------------------------------------

# Windows' finiteness: growth every 2 finite windows, backoffs down to the floor.
PATTERN = (True, True, True, True, False, True, False, False, False, False, True, True)
INITIAL, PERIOD, FACTOR, FLOOR = 2.0**6, 2, 2.0, 2.0**3


def expected_scales() -> list[float]:
    """jmp's rule, written out: the scale after each window of PATTERN."""
    scale, counter, scales = INITIAL, 0, []
    for finite in PATTERN:
        if not finite:
            scale, counter = max(scale / FACTOR, FLOOR), 0
        elif counter == PERIOD - 1:
            scale, counter = scale * FACTOR, 0
        else:
            counter += 1
        scales.append(scale)
    return scales


def initial_scale() -> jaxaccum.DynamicLossScale:
    return jaxaccum.dynamic_loss_scale(
        INITIAL, period=PERIOD, factor=FACTOR, min_loss_scale=FLOOR
    )


def test_in_step_scale_trajectory_counts_windows():
    step = jax.jit(jaxaccum.value_and_grad(f16_loss, 3, loss_scale=True))
    params, scale, scales = f16_params(), initial_scale(), []
    for window, finite in enumerate(PATTERN):
        batch = f16_batch(12, seed=window, overflow_row=None if finite else window % 12)
        _, report = step(params, batch, loss_scale=scale)
        assert bool(report.finite) == finite, f"window {window}"
        scale = report.loss_scale
        scales.append(float(scale.loss_scale))
    assert scales == expected_scales()


def test_multisteps_scale_trajectory_counts_windows():
    optimizer = jaxaccum.MultiSteps(optax.sgd(0.1), CALLS, loss_scale=initial_scale())
    update = jax.jit(optimizer.update)
    params = multi_params()
    state, scales = optimizer.init(params), []
    for window, finite in enumerate(PATTERN):
        for call in range(CALLS):
            scale = float(optimizer.loss_scale(state))
            assert window == 0 or call == 0 or scale == scales[-1], "changed mid-window"
            bad = not finite and call == window % CALLS
            grads = jax.tree.map(lambda g, s=scale: g * s, call_grads(call, bad))
            _, state = update(grads, state, params)
        assert bool(optimizer.has_updated(state)) == finite, f"window {window}"
        scales.append(float(optimizer.loss_scale(state)))
    assert scales == expected_scales()
    assert int(state.gradient_step) == sum(PATTERN)


def test_the_scale_never_grows_to_infinity():
    top = jaxaccum.dynamic_loss_scale(2.0**127, period=1)
    grown = jaxaccum.update_loss_scale(top, jnp.bool_(True))
    assert float(grown.loss_scale) == 2.0**127 and int(grown.counter) == 0


# --- Resuming a MultiSteps window through orbax --------------------------------------

NUM_CALLS, BAD_CALL = 10, 4


def save(path, tree) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore(path, like):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract)


@pytest.mark.parametrize("stop", [4, 5])  # before and after the overflowing call
def test_multisteps_resumed_mid_window_is_bitwise_identical(tmp_path, stop):
    optimizer, step = multi_step()
    fresh = multi_params()
    want = run_multi(step, fresh, optimizer.init(fresh), range(NUM_CALLS), {BAD_CALL})
    assert int(want[1].gradient_step) == 2, "3 windows closed, one skipped"

    params, state = run_multi(
        step, fresh, optimizer.init(fresh), range(stop), {BAD_CALL}
    )
    assert int(state.mini_step) != 0, "the checkpoint must be mid-window"
    save(tmp_path / "checkpoint", {"params": params, "opt_state": state})
    restored = restore(
        tmp_path / "checkpoint", {"params": fresh, "opt_state": optimizer.init(fresh)}
    )
    assert isinstance(restored["opt_state"].loss_scale.scale, jaxaccum.DynamicLossScale)
    got = run_multi(
        step,
        restored["params"],
        restored["opt_state"],
        range(stop, NUM_CALLS),
        {BAD_CALL},
    )
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal(got, want, strict=True)


# --- The option matrix under a scale -----------------------------------------------


# As test_option_matrix.py: JAXACCUM_MATRIX_EXAMPLES=3000 runs that many per
# front end, with fresh randomness.
LONG_EXAMPLES = int(os.environ.get("JAXACCUM_MATRIX_EXAMPLES", "0"))


# One test per front end, so that every one is drawn.
@pytest.mark.parametrize("path", CORE_PATHS + SHARD_PATHS)
@settings(
    max_examples=LONG_EXAMPLES or 3,
    deadline=None,
    derandomize=not LONG_EXAMPLES,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data(), exponent=st.integers(-4, 12))
def test_option_matrix_under_a_loss_scale_matches_full_batch(path, data, exponent):
    """Every front end, reduction, N, aux and report_stats, with the
    gradients scaled by a power of two per call: the results are those of the
    full batch (the same bound as unscaled: the scale is exact), the window
    finite, the next scale the rule's."""
    case = data.draw(cases((path,)))
    combo = dataclasses.replace(case.combo, loss_scale=True)
    case = dataclasses.replace(case, combo=combo)
    if combo.pad and combo.reduction == "mean":
        event("documented error: pad with mean")
        return
    if combo.path in SHARD_PATHS and combo.aux_reduction in PER_MICROBATCH_AUX:
        event("documented error: per-micro-batch aux under shard_map")
        return
    data = make_data(case)
    scale = jaxaccum.dynamic_loss_scale(2.0**exponent, period=1, min_loss_scale=2.0**-4)
    out, report = build(combo)(*inputs(case, data), loss_scale=scale)
    raw = (out, report.report) if combo.report_stats else out
    check_outcome(case, unpack(combo, raw), data)
    assert bool(report.finite)
    want = jaxaccum.update_loss_scale(scale, jnp.bool_(True))
    chex.assert_trees_all_equal(report.loss_scale, want, strict=True)
    event(f"match: {combo.path}")


def test_masked_window_out_of_range_is_not_finite_and_keeps_the_scale():
    step = jax.jit(jaxaccum.value_and_grad(f16_loss, 4, loss_scale=True, masked=True))
    scale = jaxaccum.dynamic_loss_scale(2.0**10, period=1)
    params, batch = f16_params(), f16_batch(16)
    (_, grads), report = step(
        params, batch, loss_scale=scale, active_microbatches=jnp.int32(5)
    )
    assert not bool(report.finite)
    chex.assert_trees_all_equal(report.loss_scale, scale, strict=True)
    (_, grads), report = step(
        params, batch, loss_scale=scale, active_microbatches=jnp.int32(2)
    )
    assert bool(report.finite) and float(report.loss_scale.loss_scale) == 2.0**11


# --- Errors ------------------------------------------------------------------------


def test_loss_scale_errors_name_the_argument():
    loss = lambda w, x: jnp.mean(x @ w)  # noqa: E731
    w, x = jnp.ones(2), jnp.ones((4, 2))
    scaled = jaxaccum.value_and_grad(loss, 2, loss_scale=True)
    with pytest.raises(TypeError, match="keyword argument loss_scale"):
        scaled(w, x)
    with pytest.raises(
        TypeError, match="loss_scale must be a jaxaccum.DynamicLossScale"
    ):
        scaled(w, x, loss_scale=2.0**15)
    with pytest.raises(TypeError, match="built without loss_scale=True"):
        jaxaccum.value_and_grad(loss, 2)(w, x, loss_scale=jaxaccum.dynamic_loss_scale())
    with pytest.raises(TypeError, match="loss_scale must be True or False"):
        jaxaccum.value_and_grad(loss, 2, loss_scale=jaxaccum.dynamic_loss_scale())
    with pytest.raises(ValueError, match="loss_scale.period must be >= 1"):
        scaled(w, x, loss_scale=jaxaccum.dynamic_loss_scale()._replace(period=0))
    with pytest.raises(ValueError, match="factor must be > 1.0"):
        jaxaccum.dynamic_loss_scale(factor=1.0)
    with pytest.raises(ValueError, match="loss_scale must be > 0.0"):
        jaxaccum.dynamic_loss_scale(0.0)
    with pytest.raises(ValueError, match="min_loss_scale=4.0 is above loss_scale=2.0"):
        jaxaccum.dynamic_loss_scale(2.0, min_loss_scale=4.0)
    with pytest.raises(TypeError, match="period must be an integer scalar"):
        jaxaccum.dynamic_loss_scale(period=2.5)
    with pytest.raises(ValueError, match="loss_scale needs the window's loss scale"):
        optimizer = jaxaccum.MultiSteps(optax.sgd(0.1), 2)
        optimizer.loss_scale(optimizer.init(w))


def test_select_if_finite_refuses_mismatched_trees():
    old = {"w": jnp.ones(2), "count": jnp.int32(3)}
    with pytest.raises(TypeError, match="finite must be a boolean scalar"):
        jaxaccum.select_if_finite(jnp.ones(2, bool), old, old)
    with pytest.raises(ValueError, match="same trees"):
        jaxaccum.select_if_finite(jnp.bool_(True), {"w": old["w"]}, old)
    with pytest.raises(
        ValueError, match=r"\['w'\] has shape \(2,\) and dtype bfloat16"
    ):
        jaxaccum.select_if_finite(
            jnp.bool_(True), {**old, "w": old["w"].astype(jnp.bfloat16)}, old
        )


SHARDED_CHECK = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxaccum
from test_loss_scale import (
    assert_within, f16_batch, f16_loss, f16_params, f16_tolerance)

mesh = jax.make_mesh((4, 2), ("data", "model"))
sharded = jax.jit(
    jaxaccum.shard_value_and_grad(f16_loss, 2, mesh=mesh, loss_scale=True))
params = f16_params()
specs = {"W1": P("data", "model"), "w2": P("model")}  # FSDP and tensor parallel
placed = {
    name: jax.device_put(leaf, NamedSharding(mesh, specs[name]))
    for name, leaf in params.items()
}
scale = jaxaccum.dynamic_loss_scale(2.0**14)
for bad in (None, 3, 60):  # no overflow; one in the first device's rows, the last's
    batch = f16_batch(64, overflow_row=bad)
    rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (_, grads), report = sharded(placed, rows, loss_scale=scale)
    assert bool(report.finite) == (bad is None), bad
    assert report.finite.sharding.is_fully_replicated
    want = 2.0**14 if bad is None else 2.0**13
    assert float(report.loss_scale.loss_scale) == want, report.loss_scale
    if bad is None:  # 8 rows per device and micro-batch: b = 8 of B = 64
        reference = jax.grad(f16_loss)(f16_params(jnp.float32), batch)
        tolerance = f16_tolerance(params, batch, reference, 8)
        for name in reference:
            assert_within(name, grads[name], reference[name], tolerance[name])
print("ok")
"""


def test_sharded_window_is_finite_on_every_device_or_none():
    """On 8 CPU devices (4 data x 2 model, W1 FSDP and tensor parallel), an
    overflow in any device's rows makes the window not finite everywhere; a
    finite window's gradient is the single-device one."""
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    tests = os.path.dirname(os.path.abspath(__file__))
    process = subprocess.run(
        [sys.executable, "-c", SHARDED_CHECK],
        env=env,
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    assert process.stdout.strip().endswith("ok"), process.stdout


@pytest.mark.parametrize("exponent", [64, 80])
def test_window_stats_under_a_large_scale_are_the_unscaled_ones(exponent):
    """report_stats divided each micro-batch's squared norm by the square of
    the scale in float32: from 2**64 (reached on its own where nothing
    overflows: float32 or bfloat16 compute) the squared norms read 0 and the
    noise scale went negative, at 2**80 NaN, the window finite. The scale is
    divided out of each leaf before squaring: the stats are the unscaled
    window's (a power of two: the same numbers but for the sums' order)."""
    params, batch = f16_params(jnp.float32), f16_batch()
    plain = jax.jit(jaxaccum.value_and_grad(f16_loss, 4, report_stats=True))
    scaled = jax.jit(
        jaxaccum.value_and_grad(f16_loss, 4, report_stats=True, loss_scale=True)
    )
    scale = jaxaccum.dynamic_loss_scale(2.0**exponent)
    out, report = scaled(params, batch, loss_scale=scale)
    assert bool(report.finite)
    chex.assert_trees_all_close((out, report.report), plain(params, batch), rtol=RTOL)
    assert float(report.report.microbatch_grad_sq_norm.min()) > 0


def test_a_scale_state_is_checked_in_one_place_wherever_it_comes_from():
    """A DynamicLossScale built directly (a NamedTuple) with its floor above
    its scale was accepted, and the first backoff raised the scale (4 -> 16);
    update_loss_scale given the report failed with AttributeError 'counter'
    (issue 45, case 7). Every state goes through check_loss_scale; a backoff
    never raises the scale, even traced."""
    direct = jaxaccum.DynamicLossScale(
        jnp.float32(4.0),
        jnp.int32(0),
        jnp.int32(10),
        jnp.float32(2.0),
        jnp.float32(16.0),
    )
    with pytest.raises(ValueError, match="min_loss_scale=16.0 is above"):
        jaxaccum.update_loss_scale(direct, jnp.bool_(False))
    scaled = jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2, loss_scale=True)
    with pytest.raises(ValueError, match=r"loss_scale.min_loss_scale=16.0 is above"):
        scaled(jnp.ones(2), jnp.ones((4, 2)), loss_scale=direct)
    traced = jax.jit(jaxaccum.update_loss_scale)(direct, jnp.bool_(False))
    assert float(traced.loss_scale) == 4.0  # not raised to the floor
    _, report = scaled(
        jnp.ones(2), jnp.ones((4, 2)), loss_scale=jaxaccum.dynamic_loss_scale()
    )
    with pytest.raises(TypeError, match=r"pass its loss_scale field"):
        jaxaccum.update_loss_scale(report, jnp.bool_(True))
    with pytest.raises(TypeError, match="must be a jaxaccum.DynamicLossScale"):
        jaxaccum.update_loss_scale(tuple(direct), jnp.bool_(True))
    with pytest.raises(ValueError, match=r"loss_scale must be a finite number"):
        jaxaccum.dynamic_loss_scale(float("inf"))
    with pytest.raises(ValueError, match=r"factor must be a finite number"):
        jaxaccum.dynamic_loss_scale(factor=float("nan"))


# A skipped window and the state it carries (issue 45, case 2), on every
# front end that carries state, crossed with the reports and N.


def _running_mean_loss(w, state, batch):
    """A loss whose state is a running mean of its inputs (BatchNorm's)."""
    new_state = 0.9 * state + 0.1 * jnp.mean(batch["x"], 0)
    return jnp.mean(jnp.tanh(batch["x"] @ w) * batch["boost"][:, None]), new_state


def _stateful_step(front_end, num, report):
    """``(run, initial)``: ``run(batch, scale) -> (state after, report)``
    for ``front_end``, and the state before any window."""
    import equinox as eqx
    import flax.linen as linen
    from flax import nnx

    options = {"loss_scale": True, **({report: True} if report else {})}
    w = jnp.full((FEATURES, 2), 0.01)
    zeros = jnp.zeros(FEATURES)
    if front_end in ("value_and_grad", "equinox"):
        if front_end == "value_and_grad":
            step = jax.jit(
                jaxaccum.value_and_grad(
                    _running_mean_loss,
                    num,
                    state_argnums=1,
                    batch_argnums=2,
                    **options,
                )
            )
        else:
            step = eqx.filter_jit(
                jaxaccum.equinox.filter_value_and_grad(
                    _running_mean_loss, num, state_argnums=1, batch_argnums=2, **options
                )
            )

        def run(batch, scale):
            (_, state), out = step(w, zeros, batch, loss_scale=scale)
            return state, out

        return run, zeros
    if front_end == "linen":
        model = linen.Sequential([linen.Dense(2), linen.BatchNorm(False)])
        variables = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))

        def loss(variables, batch):
            out, updates = model.apply(variables, batch["x"], mutable="batch_stats")
            return jnp.mean(out * batch["boost"][:, None]), updates

        step = jax.jit(
            jaxaccum.flax.linen_value_and_grad(
                loss, num, mutable="batch_stats", **options
            )
        )

        def run(batch, scale):
            (_, updates), out = step(variables, batch, loss_scale=scale)
            return updates["batch_stats"], out

        return run, variables["batch_stats"]

    class Net(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(FEATURES, 2, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(self.dense(x))

    net = Net()
    step = nnx.jit(
        jaxaccum.flax.nnx_value_and_grad(
            lambda net, batch: jnp.mean(net(batch["x"]) * batch["boost"][:, None]),
            num,
            **options,
        )
    )

    def stats():
        return jax.tree.map(jnp.copy, nnx.state(net, nnx.BatchStat))

    def run(batch, scale):
        _, out = step(net, batch, loss_scale=scale)
        return stats(), out

    return run, stats()


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(
    front_end=st.sampled_from(["value_and_grad", "equinox", "linen", "nnx"]),
    num=st.sampled_from([1, 4]),
    report=st.sampled_from([None, "report_stats", "report_finite"]),
)
@example(front_end="nnx", num=4, report=None)  # the case found
def test_a_skipped_window_leaves_the_carried_state_as_it_was(front_end, num, report):
    """An inf row makes the window not finite: the state it leaves is the
    state it was given, bitwise, on every front end that carries state, with
    every report (NNX wrote inf running statistics into the model); a finite
    window writes the new state."""
    scale = jaxaccum.dynamic_loss_scale()
    batch = f16_batch()
    batch = {**batch, "x": batch["x"].astype(jnp.float32) * 2.0**-12}
    bad = {**batch, "x": batch["x"].at[5].set(jnp.inf)}
    run, initial = _stateful_step(front_end, num, report)
    state, out = run(bad, scale)
    assert not bool(out.finite)
    chex.assert_trees_all_equal(state, initial)
    state, out = run(batch, scale)
    assert bool(out.finite)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state, initial)
    assert max(jax.tree.leaves(moved)) > 1e-3, moved
