"""Reliability: resuming mid-window, determinism, compile counts, non-finite values.

A job preempted in the middle of an accumulation window and resumed from an
orbax checkpoint must end with the same parameters as one that never stopped:
resumed runs are compared bitwise (``chex.assert_trees_all_equal``, tolerance
zero) with uninterrupted ones, and so are repeated runs of the same step. Both
run the same program on the same inputs on CPU, so any difference is a bug,
not rounding. Control tests show that each comparison fails when a
micro-batch is lost or counted twice.
"""

import functools
from collections.abc import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from models import classification_batch, mlp_apply, mlp_loss, mlp_params

import jaxaccum

CALLS_PER_WINDOW = 3
NUM_CALLS = 10
BAD_CALL = 4  # its gradient is NaN; skip_not_finite rejects it


# --- Checkpointing -----------------------------------------------------------


def save(path, tree) -> None:
    """Saves ``tree`` with orbax and waits until it is on disk."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore(path, like):
    """Restores the tree saved at ``path`` into the structure and dtypes of ``like``.

    ``like`` is what a restarted job builds before restoring (fresh params and
    ``optimizer.init``); without it orbax returns plain dicts and lists, not a
    ``MultiStepsState``.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, abstract)


def assert_same_tree(actual, expected) -> None:
    """Same structure (node types included), shapes, dtypes and bits."""
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
    chex.assert_trees_all_equal(actual, expected, strict=True)


# --- The Optax path: micro-batches arrive one call at a time --------------------

OPTIMIZERS = {
    "adam": lambda: optax.adam(0.05),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=0.1)
    ),
    "schedule": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(0.05, 0.01, transition_steps=3)
    ),
}


def micro_batch(call: int) -> tuple[dict, jax.Array]:
    """Call ``call``'s micro-batch and its weight (e.g. its number of tokens)."""
    batch = classification_batch(jax.random.key(100 + call), 8)
    if call == BAD_CALL:
        batch["x"] = batch["x"].at[0, 0].set(jnp.nan)
    return batch, jnp.float32(1 + call % 3)


def multisteps(name: str) -> jaxaccum.MultiSteps:
    return jaxaccum.MultiSteps(
        OPTIMIZERS[name](),
        CALLS_PER_WINDOW,
        should_skip_update_fn=optax.skip_not_finite,
    )


@functools.cache
def call_step_for(name: str, param_dtype: str) -> Callable:
    """The jitted per-call step, shared by the uninterrupted and resumed runs."""
    optimizer = multisteps(name)

    @jax.jit
    def call_step(params, opt_state, batch, weight):
        grads = jax.grad(mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params, weight=weight)
        return optax.apply_updates(params, updates), opt_state

    return call_step


def initial_params(dtype: str = "float32") -> list:
    return mlp_params(jax.random.key(0), dtype=jnp.dtype(dtype))


def run_calls(call_step, params, opt_state, calls):
    for call in calls:
        params, opt_state = call_step(params, opt_state, *micro_batch(call))
    return params, opt_state


@functools.cache
def uninterrupted(name: str, param_dtype: str) -> tuple:
    params = initial_params(param_dtype)
    return run_calls(
        call_step_for(name, param_dtype),
        params,
        multisteps(name).init(params),
        range(NUM_CALLS),
    )


@pytest.mark.parametrize(
    ("name", "param_dtype", "stop"),
    [
        ("adam", "float32", 4),  # mini_step 1, the NaN call next
        ("adam", "float32", 5),  # mini_step 1, just after the skipped call
        ("adam", "float32", 6),  # mini_step 2, one call before the window ends
        ("clip_adamw", "bfloat16", 5),
        ("schedule", "float32", 6),
    ],
)
def test_multisteps_resumed_mid_window_is_bitwise_identical(
    tmp_path, name, param_dtype, stop
):
    call_step = call_step_for(name, param_dtype)
    want = uninterrupted(name, param_dtype)
    assert int(want[1].gradient_step) == 3, "10 calls, one skipped: 3 windows"

    # The preempted job: stop after `stop` calls, mid-window, and checkpoint
    # the params, the whole optimizer state and the data position.
    params = initial_params(param_dtype)
    params, opt_state = run_calls(
        call_step, params, multisteps(name).init(params), range(stop)
    )
    assert int(opt_state.mini_step) != 0, "the checkpoint must be mid-window"
    saved = {"params": params, "opt_state": opt_state, "next_call": jnp.int32(stop)}
    expected_saved = jax.device_get(saved)
    save(tmp_path / "checkpoint", saved)

    # The restarted job builds its target from scratch: fresh params, a new
    # optimizer's init.
    fresh = initial_params(param_dtype)
    like = {
        "params": fresh,
        "opt_state": multisteps(name).init(fresh),
        "next_call": jnp.int32(0),
    }
    restored = restore(tmp_path / "checkpoint", like)
    assert isinstance(restored["opt_state"], jaxaccum.MultiStepsState)
    assert_same_tree(restored, expected_saved)

    next_call = int(restored["next_call"])
    got = run_calls(call_step, restored["params"], restored["opt_state"], [next_call])
    compiled = call_step._cache_size()
    got = run_calls(call_step, *got, range(next_call + 1, NUM_CALLS))
    assert_same_tree(got, want)
    assert call_step._cache_size() == compiled, "a resumed call retraced"


def test_resume_comparison_detects_lost_or_double_counted_micro_batches(tmp_path):
    """Controls: the bitwise comparison above fails when a resumed job loses the
    partial window (params saved without the optimizer state) or counts a
    micro-batch twice (data position not saved, the window replayed)."""
    optimizer = multisteps("adam")
    call_step = call_step_for("adam", "float32")
    want, _ = uninterrupted("adam", "float32")
    params = initial_params()

    stop = 6
    params, opt_state = run_calls(
        call_step, params, optimizer.init(params), range(stop)
    )
    assert int(opt_state.mini_step) == 2
    lost, _ = run_calls(
        call_step, params, optimizer.init(params), range(stop, NUM_CALLS)
    )
    twice, _ = run_calls(call_step, params, opt_state, range(stop - 1, NUM_CALLS))
    for name, got in [("lost", lost), ("counted twice", twice)]:
        with pytest.raises(AssertionError):
            chex.assert_trees_all_equal(got, want)
        error = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )
        assert error > 1e-4, f"{name}: params differ by only {error}"


# --- The in-step path with a Flax TrainState -----------------------------------


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.tanh(nn.Dense(16)(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(3)(x)


MODEL = DropoutMLP()
TRAIN_STEPS = 6
NUM_MICROBATCHES = 4


def dropout_loss(params, batch, key):
    logits = MODEL.apply(
        {"params": params}, batch["x"], train=True, rngs={"dropout": key}
    )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


# Built once: a TrainState's tx is static (part of the pytree structure that
# jit caches on), so a new optimizer object per TrainState would recompile.
TX = {
    "adam": optax.adam(0.05),
    "adam_every_2": jaxaccum.MultiSteps(optax.adam(0.05), 2).gradient_transformation(),
}


def create_train_state(tx_name: str) -> train_state.TrainState:
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
    tx = TX[tx_name]
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)
    # An int32 array, not TrainState's Python 0: the first call then compiles
    # the same program as every later one, and as a restored step.
    return state.replace(step=jnp.zeros([], jnp.int32))


def arrays_of(state: train_state.TrainState) -> dict:
    """A TrainState's arrays (its apply_fn and tx are not data)."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def make_train_step():
    @jax.jit
    def train_step(state, batch, base_key):
        key = jax.random.fold_in(base_key, state.step)
        loss, grads = jaxaccum.value_and_grad(
            dropout_loss, NUM_MICROBATCHES, key_argnums=2
        )(state.params, batch, key)
        return state.apply_gradients(grads=grads), loss

    return train_step


def train_batch(step: int) -> dict:
    return classification_batch(jax.random.key(200 + step), 16)


def run_steps(train_step, state, base_key, steps):
    for step in steps:
        state, _ = train_step(state, train_batch(step), base_key)
    return state


@pytest.mark.parametrize("tx_name", TX)
def test_train_state_resumed_is_bitwise_identical(tmp_path, tx_name):
    base_key = jax.random.key(7)
    train_step = make_train_step()
    want = run_steps(
        train_step, create_train_state(tx_name), base_key, range(TRAIN_STEPS)
    )

    stop = 3  # with "adam_every_2", mid-window
    state = run_steps(train_step, create_train_state(tx_name), base_key, range(stop))
    if tx_name == "adam_every_2":
        assert int(state.opt_state.mini_step) == 1
    save(tmp_path / "checkpoint", {"state": state, "base_key": base_key})

    like = {"state": create_train_state(tx_name), "base_key": jax.random.key(0)}
    restored = restore(tmp_path / "checkpoint", like)
    assert_same_tree(restored["base_key"], base_key)
    assert_same_tree(arrays_of(restored["state"]), arrays_of(state))
    assert train_step._cache_size() == 1
    got = run_steps(
        train_step,
        restored["state"],
        restored["base_key"],
        range(int(restored["state"].step), TRAIN_STEPS),
    )
    assert_same_tree(arrays_of(got), arrays_of(want))
    # One compilation for the resumed run, as in a restarted process (orbax
    # returns arrays committed to a device), and no retrace after it.
    assert train_step._cache_size() == 2


# --- Determinism -----------------------------------------------------------------

DETERMINISM_CASES = {
    "mean": dict(reduction="mean"),
    "dropout_keys": dict(key_argnums=2),
    "weighted_padded": dict(reduction="weighted", pad=True),
    "bfloat16_params": dict(param_dtype=jnp.bfloat16),
}


def determinism_problem(case: dict):
    case = dict(case)
    dtype = case.pop("param_dtype", jnp.float32)
    params = MODEL.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    batch = classification_batch(jax.random.key(1), 30)

    def loss(params, batch, key, **kwargs):
        logits = MODEL.apply(
            {"params": params}, batch["x"], train=True, rngs={"dropout": key}
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        if case.get("reduction") == "weighted":
            return jaxaccum.masked_sum(losses, kwargs["example_mask"])
        return jnp.mean(losses)

    return loss, case, params, batch


@pytest.mark.parametrize("case", DETERMINISM_CASES)
def test_same_step_twice_gives_bitwise_identical_gradients(case):
    loss, kwargs, params, batch = determinism_problem(DETERMINISM_CASES[case])
    kwargs.setdefault("key_argnums", ())
    num = 4 if kwargs.get("pad") else 5  # 4 does not divide 30: padded
    key = jax.random.key(3)

    results = []
    for _ in range(2):  # two separately traced and compiled functions
        step = jax.jit(jaxaccum.value_and_grad(loss, num, **kwargs))
        results += [step(params, batch, key), step(params, batch, key)]
    for result in results[1:]:
        assert_same_tree(result, results[0])
    chex.assert_tree_all_finite(results[0])


def test_determinism_comparison_sees_a_different_key():
    """Control: the comparison above is sensitive to one changed dropout mask."""
    loss, kwargs, params, batch = determinism_problem(DETERMINISM_CASES["dropout_keys"])
    step = jax.jit(jaxaccum.value_and_grad(loss, 5, **kwargs))
    with pytest.raises(AssertionError):
        assert_same_tree(
            step(params, batch, jax.random.key(3)),
            step(params, batch, jax.random.key(4)),
        )


# --- Compilation counts -----------------------------------------------------------


def test_hundred_steps_compile_once():
    traces = []
    optimizer = jaxaccum.MultiSteps(optax.adam(1e-2), 3)

    @jax.jit
    def train_step(params, opt_state, batch):
        traces.append(1)
        loss, grads = jaxaccum.value_and_grad(mlp_loss, 4)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = initial_params()
    opt_state = optimizer.init(params)
    init_types = jax.tree.map(jax.typeof, (params, opt_state))
    for step in range(100):
        batch = classification_batch(jax.random.key(step), 16)
        params, opt_state, loss = train_step(params, opt_state, batch)
    assert int(opt_state.gradient_step) == 33
    assert np.isfinite(float(loss))
    assert (len(traces), train_step._cache_size()) == (1, 1), (
        f"{len(traces)} traces, {train_step._cache_size()} compilations in 100 steps"
    )
    # Why: the state keeps its dtypes (and weak types) through emitting and
    # mid-window calls, so every call has the first call's signature.
    assert jax.tree.map(jax.typeof, (params, opt_state)) == init_types

    # Control: the counters see a retrace (here, a batch in another dtype).
    batch = classification_batch(jax.random.key(0), 16)
    batch["x"] = batch["x"].astype(jnp.bfloat16)
    train_step(params, opt_state, batch)
    assert (len(traces), train_step._cache_size()) == (2, 2)


def test_changing_num_microbatches_compiles_once_per_value():
    traces = []

    @jax.jit(static_argnames="num_microbatches")
    def grads_step(params, batch, num_microbatches):
        traces.append(num_microbatches)
        return jaxaccum.grad(mlp_loss, num_microbatches)(params, batch)

    params = initial_params()
    sequence = [1, 2, 4, 2, 8, 1, 4, 8, 2, 16]
    for step, num in enumerate(sequence):
        grads_step(params, classification_batch(jax.random.key(step), 16), num)
    assert sorted(traces) == sorted(set(sequence)), traces
    assert grads_step._cache_size() == len(set(sequence))


# --- Non-finite values in one micro-batch ----------------------------------------


@functools.cache
def accumulated_grads() -> Callable:
    return jax.jit(jaxaccum.grad(mlp_loss, 4))


def nan_batch(batch_size=16, bad_example=5, bad_value=jnp.nan) -> dict:
    batch = classification_batch(jax.random.key(11), batch_size)
    batch["x"] = batch["x"].at[bad_example, 0].set(bad_value)
    return batch


@pytest.mark.parametrize("bad_value", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_multisteps_skips_non_finite_micro_batch_and_keeps_state(bad_value):
    """One micro-batch's gradient (from in-step accumulation) is non-finite:
    ``optax.skip_not_finite`` rejects that call, every field of the state but
    ``skip_state`` is bitwise unchanged, and the window's result is that of
    the good micro-batches alone."""
    optimizer = jaxaccum.MultiSteps(
        optax.adam(0.05), 2, should_skip_update_fn=optax.skip_not_finite
    )
    grads_fn = accumulated_grads()
    update = jax.jit(optimizer.update)
    params = initial_params()
    good = [classification_batch(jax.random.key(k), 16) for k in (21, 22)]
    bad_grads = grads_fn(params, nan_batch(bad_value=bad_value))
    assert not all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(bad_grads))

    state = optimizer.init(params)
    _, state = update(grads_fn(params, good[0]), state, params)
    updates, skipped = update(bad_grads, state, params)
    assert bool(skipped.skip_state["should_skip"])
    assert int(skipped.skip_state["num_not_finite"]) > 0
    assert_same_tree(updates, optax.tree.zeros_like(updates))
    assert_same_tree(skipped._replace(skip_state=()), state._replace(skip_state=()))
    updates, state = update(grads_fn(params, good[1]), skipped, params)
    assert bool(optimizer.has_updated(state))

    # Another program, so equal to rounding (float32): the same two gradients
    # added and halved elementwise (correctly rounded, so at most a fused
    # multiply-add's 1 ulp apart per op; Adam's few ops stay under 8 ulp, 1e-6).
    # A leaked NaN or a miscounted window would be far off.
    reference = jaxaccum.MultiSteps(optax.adam(0.05), 2)
    ref_state = reference.init(params)
    for batch in good:
        want, ref_state = reference.update(grads_fn(params, batch), ref_state, params)
    chex.assert_trees_all_close(updates, want, rtol=1e-6, atol=1e-9)
    chex.assert_tree_all_finite((updates, state))


@pytest.mark.parametrize("bad_weight", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_multisteps_skips_a_non_finite_weight(bad_weight):
    """A token count that came out NaN or inf must be rejected like a NaN
    gradient: otherwise ``acc_grads`` and ``acc_weight`` become non-finite and
    the window emits NaN updates, though ``skip_not_finite`` was asked for."""
    optimizer = jaxaccum.MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    )
    update = jax.jit(optimizer.update)
    params = {"w": jnp.zeros(2)}
    state = optimizer.init(params)
    _, state = update({"w": jnp.array([1.0, 2.0])}, state, params, weight=1.0)
    updates, skipped = update(
        {"w": jnp.array([5.0, 5.0])}, state, params, weight=bad_weight
    )
    assert_same_tree(updates, {"w": jnp.zeros(2)})
    assert_same_tree(skipped._replace(skip_state=()), state._replace(skip_state=()))
    updates, state = update({"w": jnp.array([3.0, 0.0])}, skipped, params, weight=3.0)
    assert bool(optimizer.has_updated(state))
    chex.assert_trees_all_close(updates, {"w": -jnp.array([2.5, 0.5])}, rtol=0)


def test_in_step_non_finite_micro_batch_is_never_silently_finite():
    """Without a report, a non-finite micro-batch still shows: it makes the
    window's value and gradient non-finite (never a finite wrong answer), so
    ``optax.apply_if_finite`` skips the update and keeps the params."""
    params = initial_params()
    optimizer = optax.apply_if_finite(optax.adam(0.05), max_consecutive_errors=3)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jaxaccum.value_and_grad(mlp_loss, 4)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    new_params, new_state, loss = train_step(params, opt_state, nan_batch())
    assert not np.isfinite(float(loss))
    assert not bool(new_state.last_finite)
    assert_same_tree(new_params, params)
    new_params, new_state, loss = train_step(
        params, opt_state, classification_batch(jax.random.key(1), 16)
    )
    assert bool(new_state.last_finite) and np.isfinite(float(loss))


# --- The in-step finite report -----------------------------------------------------


def test_in_step_reports_which_micro_batch_is_non_finite():
    """``value_and_grad(..., report_finite=True)`` returns
    ``(out, report)``, ``out`` being what it returns otherwise, and ``report`` a
    ``jaxaccum.FiniteReport`` with ``microbatch_finite`` (bool ``(N,)``: micro-
    batch ``k``'s loss and gradient are all finite) and ``finite`` (bool scalar,
    all of them). It is computed inside the scan, so it names the culprit even
    when the window's result hides it (a zero total weight), and it lets a
    train step skip the update with ``jax.lax.cond``."""
    params = initial_params()
    fun = jax.jit(jaxaccum.value_and_grad(mlp_loss, 4, report_finite=True))

    # Example 5 of 16 is in micro-batch 5 mod 4 = 1 (strided split).
    (value, grads), report = fun(params, nan_batch(bad_example=5))
    assert report.microbatch_finite.shape == (4,)
    assert report.microbatch_finite.tolist() == [True, False, True, True]
    assert not bool(report.finite)
    assert report.finite.dtype == jnp.bool_
    (value, grads), report = fun(params, classification_batch(jax.random.key(1), 16))
    assert bool(report.finite) and bool(report.microbatch_finite.all())
    chex.assert_tree_all_finite((value, grads))

    # N == 1, the plain jax.value_and_grad path, reports too.
    _, report = jax.jit(jaxaccum.value_and_grad(mlp_loss, 1, report_finite=True))(
        params, nan_batch()
    )
    assert report.microbatch_finite.tolist() == [False]

    # A zero-weight window gives zeros, but a NaN computed in it is reported.
    def masked_mean_parts(params, batch):
        logits = mlp_apply(params, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.sum(losses * 0.0), jnp.float32(0.0)  # 0 * NaN leaks NaN

    (value, grads), report = jax.jit(
        jaxaccum.value_and_grad(
            masked_mean_parts, 4, reduction="weighted", report_finite=True
        )
    )(params, nan_batch(bad_example=6))
    assert float(value) == 0.0
    assert report.microbatch_finite.tolist() == [True, True, False, True]

    # Skipping the update on a non-finite window, state and all.
    optimizer = optax.adam(0.05)

    @jax.jit
    def train_step(params, opt_state, batch):
        (loss, grads), report = jaxaccum.value_and_grad(
            mlp_loss, 4, report_finite=True
        )(params, batch)

        def apply(params, opt_state):
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(
            report.finite, apply, lambda *state: state, params, opt_state
        )
        return params, opt_state, report

    opt_state = optimizer.init(params)
    new_params, new_opt_state, report = train_step(params, opt_state, nan_batch())
    assert not bool(report.finite)
    assert_same_tree((new_params, new_opt_state), (params, opt_state))
