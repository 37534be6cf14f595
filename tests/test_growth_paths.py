"""Growing the batch along each path: exact at every size, no recompile per step.

A controller (BatchRamp, NoiseScaleBatch) sizes each window; the window
runs across calls (MultiSteps with every_k= from the controller's state), in
one masked program (value_and_grad(masked=True)), or in one program per size
compiled ahead. The data is noise_population's regression population.

Tolerances. Across calls, the window's gradient is the same sums as the
in-step one, taken in another order: tolerances.RTOL / ATOL (derived there).
The window's noise estimates divide differences of squared norms, so their
inputs' error (twice the gradients', a square) is amplified by the condition
number of the difference, computed from the values. The masked window runs the
same micro-batches, of the same shapes, in the same order as the unmasked one:
a few float32 ulp from fusion around the lax.cond, rtol 1e-6 (8 ulp) as in
test_masked.py. A checkpointed and resumed run executes the same compiled
programs on the same inputs as an uninterrupted one: bitwise equal.
"""

import operator

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from noise_population import population
from tolerances import ATOL, RTOL

import jaxaccum
from jaxaccum.growth import BatchRamp, NoiseScaleBatch, scale_by_batch_learning_rate

MICRO = 4  # rows per micro-batch
MASKED_RTOL = MASKED_ATOL = 1e-6  # same micro-batches and order; see docstring
LEARNING_RATE = 0.1


def make_loss(reduction, traces):
    """A regression loss that counts its traces in ``traces``."""

    def loss(w, batch):
        traces.append(1)
        losses = 0.5 * (batch["x"] @ w - batch["y"]) ** 2
        if reduction == "mean":
            return jnp.mean(losses)
        return jaxaccum.masked_sum(losses, batch["mask"])

    return loss


def rows(start, count):
    """``count`` rows of the population from ``start`` (wrapping), with a
    token mask for the weighted loss: the data loader, by position."""
    x, y = population()
    index = (start + np.arange(count)) % x.shape[0]
    tokens = np.random.default_rng(0).random(x.shape[0]) < 0.7  # uneven counts
    return {"x": np.asarray(x)[index], "y": np.asarray(y)[index], "mask": tokens[index]}


def call_weight(micro_batch, reduction):
    """A call's share of the window: its examples, or its tokens."""
    if reduction == "mean":
        return jnp.float32(micro_batch["x"].shape[0])
    return jnp.float32(micro_batch["mask"].sum())


def micro_batch_at(micro_batches, call):
    """Micro-batch ``call`` of ``split_batch``'s stacked micro-batches."""
    return jax.tree.map(operator.itemgetter(call), micro_batches)


def assert_estimates_close(got, want):
    """The noise estimates, within the inputs' error times their condition."""
    # b = W / N' over the N' micro-batches with weight, as the estimators take it.
    big = float(want.big_batch)
    small = big / np.count_nonzero(want.small_batch)
    small_sq = float(jnp.sum(want.small_batch * want.microbatch_grad_sq_norm)) / big
    big_sq = float(want.grad_sq_norm)
    norm_condition = (big * big_sq + small * small_sq) / abs(
        big * big_sq - small * small_sq
    )
    trace_condition = (small_sq + big_sq) / abs(small_sq - big_sq)
    for name, condition in (
        ("gradient_norm_sq", norm_condition),
        ("gradient_noise_trace", trace_condition),
    ):
        # Squared norms carry twice the gradients' relative error.
        rtol = 2 * RTOL * condition + RTOL
        np.testing.assert_allclose(
            getattr(got, name), getattr(want, name), rtol=rtol, err_msg=name
        )


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_across_calls_window_from_controller_is_one_inner_step(reduction):
    traces = []
    loss = make_loss(reduction, traces)
    ramp = BatchRamp(MICRO, {0: 2, 4 * MICRO: 4, 12 * MICRO: 8})
    opt = jaxaccum.MultiSteps(optax.sgd(LEARNING_RATE), None, track_noise_scale=True)
    reference = jaxaccum.value_and_grad(
        make_loss(reduction, []),
        microbatch_size=MICRO,
        reduction=reduction,
        report_stats=True,
    )

    @jax.jit
    def train_step(params, opt_state, ramp_state, micro_batch):
        grads = jax.grad(lambda w: loss_value(loss(w, micro_batch)))(params)
        updates, opt_state = opt.update(
            grads,
            opt_state,
            params,
            every_k=ramp_state.num_microbatches,
            weight=call_weight(micro_batch, reduction),
        )
        ramp_state = jax.lax.cond(
            opt.has_updated(opt_state),
            lambda: ramp.update(ramp_state, opt.window_stats(opt_state)),
            lambda: ramp_state,
        )
        return optax.apply_updates(params, updates), opt_state, ramp_state, updates

    params, ramp_state = jnp.zeros(6), ramp.init()
    opt_state, sizes, position = opt.init(params), [], 0
    # Tokens are ~70% of the examples: the weighted ramp takes longer.
    for _ in range(5 if reduction == "mean" else 7):
        num = ramp.num_microbatches(ramp_state)  # one window ahead, for the loader
        window = rows(position, num * MICRO)
        position += num * MICRO
        (_, grads), want_stats = reference(params, window)
        micro_batches = jaxaccum.split_batch(window, num)
        for call in range(num):
            micro_batch = micro_batch_at(micro_batches, call)
            params, opt_state, ramp_state, updates = train_step(
                params, opt_state, ramp_state, micro_batch
            )
        sizes.append(num)
        assert opt.has_updated(opt_state), f"window of {num} calls did not emit"
        # The same sums in another order (tolerances.py); SGD scales them.
        chex.assert_trees_all_close(
            updates, -LEARNING_RATE * grads, rtol=RTOL, atol=LEARNING_RATE * ATOL
        )
        got_stats = opt.window_stats(opt_state)
        # Sums of integer weights, exact in float32.
        assert float(got_stats.big_batch) == float(want_stats.big_batch)
        assert_estimates_close(got_stats, want_stats)
    if reduction == "mean":
        assert sizes == [2, 2, 4, 4, 8], sizes
    assert len(set(sizes)) == 3, sizes
    # One compiled step for every window length: the loss traced once.
    assert train_step._cache_size() == 1 and len(traces) == 1, (
        train_step._cache_size(),
        len(traces),
    )


def loss_value(out):
    """The differentiated scalar: a "weighted" loss's mean over its tokens
    (0 for a micro-batch without tokens: it has weight 0 in the window)."""
    if isinstance(out, tuple):
        total, count = out
        return total / jnp.maximum(count, 1)
    return out


def test_every_k_changed_mid_window_ends_it_at_the_first_call_reaching_it():
    forwarded = []

    def inner_update(updates, state, params=None, **extra_args):
        forwarded.append(sorted(extra_args))
        return updates, state

    inner = optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(), inner_update
    )
    opt = jaxaccum.MultiSteps(inner, None)
    params = jnp.zeros(1)
    state, emitted = opt.init(params), []
    for every_k in (4, 4, 4, 2, 2, 3, 3, 3):
        _, state = opt.update(
            jnp.ones(1), state, params, every_k=every_k, weight=2, hint=0
        )
        emitted.append(bool(opt.has_updated(state)))
    # Calls so far 3 >= 2 on the fourth call; then a window of 3.
    assert emitted == [False, False, False, True, False, False, True, False], emitted
    # every_k and weight stay with MultiSteps; the rest reaches the inner one.
    assert set(map(tuple, forwarded)) == {("hint",)}, forwarded


@pytest.mark.parametrize(
    ("every_k", "error", "message"),
    [
        (None, TypeError, "every_k=num_calls"),
        (0, ValueError, "every_k must be >= 1"),
        (2.0, TypeError, "every_k must be an integer scalar"),
        (True, TypeError, "got True of type bool"),
        ("2", TypeError, "every_k must be an integer scalar.*got '2' of type str"),
        (jnp.ones(2, jnp.int32), TypeError, r"shape \(2,\)"),
    ],
)
def test_every_k_errors_say_what_to_pass(every_k, error, message):
    opt = jaxaccum.MultiSteps(optax.sgd(1.0), None)
    state = opt.init(jnp.zeros(1))
    with pytest.raises(error, match=message):
        opt.update(jnp.ones(1), state, jnp.zeros(1), every_k=every_k)


def test_window_stats_needs_track_noise_scale_and_is_nan_mid_window():
    opt = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    with pytest.raises(ValueError, match="track_noise_scale=True"):
        opt.window_stats(opt.init(jnp.zeros(1)))
    opt = jaxaccum.MultiSteps(optax.sgd(1.0), 2, track_noise_scale=True)
    _, state = opt.update(jnp.ones(1), opt.init(jnp.zeros(1)), jnp.zeros(1))
    stats = opt.window_stats(state)
    assert np.isnan(stats.big_batch) and not stats.finite, stats
    assert stats.small_batch.shape == (0,), stats.small_batch.shape


def masked_train_step(loss, controller, opt, max_microbatches):
    """One jitted step for every window size: the controller's state sets the
    active micro-batches, and the window's stats update it."""
    accumulated = jaxaccum.value_and_grad(
        loss, max_microbatches, masked=True, report_stats=True
    )

    @jax.jit
    def train_step(params, opt_state, controller_state, window):
        (_, grads), stats = accumulated(
            params, window, active_microbatches=controller_state.num_microbatches
        )
        updates, opt_state = opt.update(
            grads, opt_state, params, batch_size=stats.big_batch
        )
        controller_state = controller.update(controller_state, stats)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            controller_state,
            updates,
        )

    return train_step


def test_masked_window_follows_the_ramp_in_one_compile():
    traces = []
    loss = make_loss("mean", traces)
    ramp = BatchRamp(MICRO, {0: 1, 2 * MICRO: 2, 6 * MICRO: 4, 14 * MICRO: 6})
    largest = max(ramp.possible_num_microbatches)
    opt = optax.with_extra_args_support(optax.sgd(LEARNING_RATE))
    train_step = masked_train_step(loss, ramp, opt, largest)
    params, ramp_state = jnp.zeros(6), ramp.init()
    opt_state, sizes = opt.init(params), []
    for _ in range(7):
        num = ramp.num_microbatches(ramp_state)
        window = rows(int(ramp_state.examples_seen.total), num * MICRO)
        want_updates, _ = opt.update(
            jax.jit(jaxaccum.value_and_grad(loss, num))(params, window)[1], opt_state
        )
        params, opt_state, ramp_state, updates = train_step(
            params,
            opt_state,
            ramp_state,
            jaxaccum.pad_microbatches(window, num, largest),
        )
        sizes.append(num)
        chex.assert_trees_all_close(
            updates, want_updates, rtol=MASKED_RTOL, atol=MASKED_ATOL
        )
    # Examples seen after each window: 4, 8 (key 8), 16, 24 (key 24), 40, 56
    # (key 56).
    assert sizes == [1, 1, 2, 2, 4, 4, 6], sizes
    assert train_step._cache_size() == 1, train_step._cache_size()


def test_one_compile_per_size_and_all_sizes_compiled_ahead():
    traces = []
    ramp = BatchRamp(MICRO, {0: 1, 2 * MICRO: 2, 6 * MICRO: 4})
    accumulated = jaxaccum.value_and_grad(
        make_loss("mean", traces), microbatch_size=MICRO, report_stats=True
    )
    opt = optax.sgd(LEARNING_RATE)

    def train_step(params, opt_state, ramp_state, window):
        (_, grads), stats = accumulated(params, window)
        updates, opt_state = opt.update(grads, opt_state, params)
        ramp_state = ramp.update(ramp_state, stats)
        return optax.apply_updates(params, updates), opt_state, ramp_state

    def train(step_for, windows):
        params, ramp_state = jnp.zeros(6), ramp.init()
        opt_state, sizes = opt.init(params), []
        for _ in range(windows):
            num = ramp.num_microbatches(ramp_state)
            window = rows(int(ramp_state.examples_seen.total), num * MICRO)
            params, opt_state, ramp_state = step_for(num)(
                params, opt_state, ramp_state, window
            )
            sizes.append(num)
        return params, sizes

    jitted = jax.jit(train_step)
    params, sizes = train(lambda num: jitted, 6)
    assert sizes == [1, 1, 2, 2, 4, 4], sizes
    # One program per distinct size, whatever the number of windows.
    assert jitted._cache_size() == len(set(sizes)), jitted._cache_size()

    # Ahead of time: every size the ramp can ask for, compiled at the start.
    def window_shape(num):
        return {
            name: jax.ShapeDtypeStruct((num * MICRO, *leaf.shape[1:]), leaf.dtype)
            for name, leaf in rows(0, 1).items()
        }

    start = (jnp.zeros(6), opt.init(jnp.zeros(6)), ramp.init())
    compiled = {
        num: jax.jit(train_step).lower(*start, window_shape(num)).compile()
        for num in ramp.possible_num_microbatches
    }
    traced_before_training = len(traces)
    ahead_params, ahead_sizes = train(compiled.__getitem__, 6)
    assert len(traces) == traced_before_training, "training traced again"
    assert ahead_sizes == sizes, ahead_sizes
    # The same programs on the same inputs.
    chex.assert_trees_all_equal(ahead_params, params)


def growing_optimizer():
    """Adam whose learning rate follows the batch, scheduled in examples."""
    schedule = optax.linear_schedule(0.0, 0.05, transition_steps=64 * MICRO)
    return optax.chain(
        optax.scale_by_adam(),
        scale_by_batch_learning_rate(schedule, base_batch=2 * MICRO),
    )


def growing_controller():
    # No band and a target far beyond the largest window: it starts at 2 (kappa
    # does) and jumps to its largest once 4 effective windows are in.
    return NoiseScaleBatch(MICRO, 8, kappa=1e6, standard_errors=0.0)


def in_step_path():
    """Fresh objects for the masked in-step path: ``(init, run_window)``."""
    controller, opt = growing_controller(), growing_optimizer()
    largest = max(controller.possible_num_microbatches)
    train_step = masked_train_step(make_loss("mean", []), controller, opt, largest)

    def run_window(state):
        params, opt_state, controller_state = state
        num = controller.num_microbatches(controller_state)
        window = rows(int(controller_state.examples_seen.total), num * MICRO)
        window = jaxaccum.pad_microbatches(window, num, largest)
        return train_step(params, opt_state, controller_state, window)[:3], num

    def init():
        return jnp.zeros(6), opt.init(jnp.zeros(6)), controller.init()

    return init, run_window


def across_calls_path():
    """Fresh objects for the across-calls path: ``(init, run_window)``."""
    controller, loss = growing_controller(), make_loss("mean", [])
    opt = jaxaccum.MultiSteps(growing_optimizer(), None, track_noise_scale=True)

    @jax.jit
    def train_step(params, opt_state, controller_state, micro_batch):
        num = controller_state.num_microbatches
        updates, opt_state = opt.update(
            jax.grad(loss)(params, micro_batch),
            opt_state,
            params,
            every_k=num,
            weight=MICRO,
            batch_size=num * MICRO,  # for the learning rate, on the last call
        )
        controller_state = jax.lax.cond(
            opt.has_updated(opt_state),
            lambda: controller.update(controller_state, opt.window_stats(opt_state)),
            lambda: controller_state,
        )
        return optax.apply_updates(params, updates), opt_state, controller_state

    def run_window(state):
        num = controller.num_microbatches(state[2])
        window = rows(int(state[2].examples_seen.total), num * MICRO)
        micro_batches = jaxaccum.split_batch(window, num)
        for call in range(num):
            state = train_step(*state, micro_batch_at(micro_batches, call))
        return state, num

    def init():
        return jnp.zeros(6), opt.init(jnp.zeros(6)), controller.init()

    return init, run_window


def train_windows(run_window, state, count):
    sizes = []
    for _ in range(count):
        state, num = run_window(state)
        sizes.append(num)
    return state, sizes


@pytest.mark.parametrize("path", [in_step_path, across_calls_path])
def test_resume_mid_ramp_from_orbax_is_bitwise_the_uninterrupted_run(tmp_path, path):
    init, run_window = path()
    through, through_sizes = train_windows(run_window, init(), 12)
    middle, first_sizes = train_windows(run_window, init(), 5)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "checkpoint", middle)
    checkpointer.wait_until_finished()

    # A new process: new controller, optimizer and compiled step, and the
    # state restored into the structure a fresh init gives.
    init, run_window = path()
    restored = checkpointer.restore(tmp_path / "checkpoint", init())
    chex.assert_trees_all_equal(restored, middle)
    after, second_sizes = train_windows(run_window, restored, 7)
    assert first_sizes + second_sizes == through_sizes, (first_sizes, second_sizes)
    # Resumed mid-estimate: the averages held windows, and the batch grew after.
    assert int(middle[2].noise.num_windows) == 5, middle[2].noise
    assert first_sizes[-1] < second_sizes[-1], through_sizes
    chex.assert_trees_all_equal(after, through)
