"""FP8 with delayed scaling (Flax's ``fp8_ops``) through the window.

Each FP8 matmul keeps amax histories and scales in the
``_overwrite_with_gradient`` collection; their "gradient" is their new value,
and ``TrainState.apply_gradients`` writes it over the old. Across a window
they combine by max, and every micro-batch is differentiated at its share of
the window, so its backward's cotangents (whose amax the output-gradient
history records) are the big batch's.

Claims and tolerances. The big batch and the window quantize with the same
scales (computed from the window-start histories), so the kernel histories
and the first layer's input history, maxima of the same float32 values, are
equal bitwise. The output-gradient amax is the max of cotangents that are
the big batch's up to float32 rounding (the same sums in another order), a
later layer's input amax the max of activations a matmul computed (rounded
by how many rows it holds), and the parameters' gradients likewise: RTOL,
ATOL (tests/tolerances.py). The rows differ in size
by two orders of magnitude, so averaging the maxima (6.57 for 7.54 in the
issue's example) or differentiating each micro-batch at N times the big
batch's cotangents moves them by far more.
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax.linen import fp8_ops
from flax.training import train_state
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from tolerances import ATOL, RTOL

import jaxaccum
import jaxaccum.flax
import jaxaccum.testing

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
    batch's bitwise (maxima of values nothing computed: the kernels', the
    first layer's inputs', and the scales from them); the rest, equal to
    float32 rounding (maxima of cotangents, and of a later layer's inputs,
    which a matmul computed: XLA's CPU dot rounds by how many rows it holds,
    differently per instruction set)."""
    leaves = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            grads[fp8_ops.OVERWRITE_WITH_GRADIENT]
        )
    }

    def computed(path):
        return "output_grad" in path or ("input" in path and "Dense_0" not in path)

    rounded = {k: v for k, v in leaves.items() if computed(k)}
    exact = {k: v for k, v in leaves.items() if not computed(k)}
    return grads["params"], exact, rounded


def check_step(actual, expected, step):
    params, exact, rounded = split_metadata(actual[1])
    params_e, exact_e, rounded_e = split_metadata(expected[1])
    chex.assert_trees_all_equal(exact, exact_e, custom_message=f"step {step}")
    chex.assert_trees_all_close(
        rounded, rounded_e, rtol=RTOL, atol=0, custom_message=f"step {step}"
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


def history_entries(params):
    """How many steps each input amax history has recorded (entries > 0)."""
    histories = {
        jax.tree_util.keystr(path): int(jnp.sum(leaf > 0))
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            params[fp8_ops.OVERWRITE_WITH_GRADIENT]
        )
        if "input_amax_history" in jax.tree_util.keystr(path)
    }
    return set(histories.values())


def check_params(actual, expected, step):
    """A TrainState's params after a step from the same state as the big
    batch's: the metadata ``split_metadata`` says bitwise, the rest and the
    parameters to float32 rounding."""
    params, exact, rounded = split_metadata(actual)
    params_e, exact_e, rounded_e = split_metadata(expected)
    message = f"step {step}"
    chex.assert_trees_all_equal(exact, exact_e, custom_message=message)
    chex.assert_trees_all_close(
        rounded, rounded_e, rtol=RTOL, atol=0, custom_message=message
    )
    chex.assert_trees_all_close(
        params, params_e, rtol=RTOL, atol=ATOL, custom_message=message
    )


def check_trajectory(actual, expected):
    """Params after several steps of their own training against the big
    batch's: parameters within RTOL, so a max of values computed from them
    within that plus a contraction's rounding (RTOL / 2): 2 RTOL."""
    chex.assert_trees_all_close(actual, expected, rtol=2 * RTOL, atol=ATOL)


def big_batch_step(loss):
    return jax.jit(
        lambda state, batch: state.apply_gradients(
            grads=jax.grad(loss)(state.params, batch)
        )
    )


def test_fp8_through_linen_train_step():
    """Flax's FP8 layout (the whole variables in ``TrainState.params``)
    through ``jaxaccum.flax.linen_train_step``: ``grads`` holds the params and
    the metadata, and ``apply_gradients`` overwrites the metadata."""
    state, loss = make_state(OPS["direct"])
    step = jax.jit(jaxaccum.flax.linen_train_step(loss, 4))
    big = big_batch_step(loss)
    trained = {"big": state, "window": state}
    for index in range(STEPS):
        batch = batch_of(jax.random.key(index + 1))
        from_big, _ = step(trained["big"], batch)
        trained["big"] = big(trained["big"], batch)
        check_params(from_big.params, trained["big"].params, index)
        trained["window"], _ = step(trained["window"], batch)
    check_trajectory(trained["window"].params, trained["big"].params)
    assert history_entries(trained["window"].params) == {STEPS}


def multisteps_call(loss, calls):
    """One call of a window of ``calls``: the user's backward at the big
    batch's scale (the loss divided by the calls, the window summed), so its
    output-gradient amax is the big batch's."""

    def call(state, microbatch):
        grads = jax.grad(lambda v, b: loss(v, b) / calls)(state.params, microbatch)
        return state.apply_gradients(grads=grads)

    return jax.jit(call)


@pytest.mark.parametrize("wrapper", ["MultiSteps", "accumulate"])
def test_fp8_across_calls_holds_the_metadata_for_the_window(wrapper):
    """``jaxaccum.flax.TrainState`` with ``MultiSteps``: every call of a window
    runs with the window-start metadata (bitwise), the window's maxima arrive
    once, at its end, equal to the big batch's; Flax's own TrainState writes
    each call's over the last, so its histories roll once per call."""
    calls = 4
    state, loss = make_state(OPS["direct"])
    build = getattr(jaxaccum, wrapper)
    tx = build(optax.sgd(1e-3), calls, use_grad_mean=False)
    params = state.params
    ours = jaxaccum.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    flax_own = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    free = ours
    call, big = multisteps_call(loss, calls), big_batch_step(loss)
    for index in range(STEPS):
        batch = batch_of(jax.random.key(index + 1))
        ours = ours.replace(params=state.params)  # the window from the big's state
        start = ours.params[fp8_ops.OVERWRITE_WITH_GRADIENT]
        for k in range(calls):
            microbatch = jax.tree.map(lambda x, k=k: x[k::calls], batch)
            if k:  # mid-window: the window-start values, bitwise
                chex.assert_trees_all_equal(
                    ours.params[fp8_ops.OVERWRITE_WITH_GRADIENT], start
                )
            ours, flax_own = call(ours, microbatch), call(flax_own, microbatch)
            free = call(free, microbatch)  # the window's own training
        state = big(state, batch)
        check_params(ours.params, state.params, index)
    assert history_entries(ours.params) == {STEPS}
    check_trajectory(free.params, state.params)
    assert history_entries(flax_own.params) == {min(HISTORY, STEPS * calls)}


def test_multisteps_metadata_is_checked():
    tx = jaxaccum.MultiSteps(optax.sgd(1.0), 2)
    params, metadata = {"w": jnp.zeros(2)}, {"amax": jnp.zeros(3)}
    plain, held = tx.init(params), tx.init(params, metadata=metadata)
    with pytest.raises(ValueError, match="only if init got it"):
        tx.update(params, plain, params, metadata=metadata)
    with pytest.raises(ValueError, match="only if init got it"):
        tx.metadata(plain, metadata)
    with pytest.raises(ValueError, match="holds FP8 metadata"):
        tx.update(params, held, params)
    with pytest.raises(ValueError, match="update's metadata is not shaped like"):
        tx.update(params, held, params, metadata={"amax": jnp.zeros(4)})
    # Issue 55, case 3: the whole variables instead of their metadata failed
    # in jax.tree.map with a pytree-structure error.
    variables = {"params": params, "_overwrite_with_gradient": metadata}
    with pytest.raises(ValueError, match="current is not shaped like") as info:
        tx.metadata(held, variables)
    assert "['params']['w']" in str(info.value), info.value
    with pytest.raises(ValueError, match="metadata's current is not") as info:
        tx.metadata(held, {"amax": jnp.zeros(4)})
    assert "(4,)" in str(info.value) and "(3,)" in str(info.value), info.value


def test_multisteps_metadata_skips_what_the_window_skips():
    """A call ``should_skip_update_fn`` drops adds nothing to the maxima; a
    window a loss scale's overflow skips keeps its start values."""
    tx = jaxaccum.MultiSteps(
        optax.sgd(1.0), 2, should_skip_update_fn=optax.skip_not_finite
    )
    params, start = {"w": jnp.zeros(2)}, {"amax": jnp.zeros(1)}
    state = tx.init(params, metadata=start)
    calls = [(1.0, 5.0), (jnp.inf, 9.0), (1.0, 2.0)]  # (gradient, amax)
    for grad, amax in calls:
        _, state = tx.update(
            {"w": jnp.full(2, grad)},
            state,
            params,
            metadata={"amax": jnp.full(1, amax)},
        )
    chex.assert_trees_all_equal(tx.metadata(state, start), {"amax": jnp.full(1, 5.0)})
    scaled = jaxaccum.MultiSteps(
        optax.sgd(1.0), 2, loss_scale=jaxaccum.dynamic_loss_scale()
    )
    state = scaled.init(params, metadata=start)
    for grad, amax in calls[1:]:  # the window's first call overflows
        _, state = scaled.update(
            {"w": jnp.full(2, grad)},
            state,
            params,
            metadata={"amax": jnp.full(1, amax)},
        )
    assert not scaled.has_updated(state)
    chex.assert_trees_all_equal(scaled.metadata(state, start), start)


def test_diagnose_and_the_assertion_read_fp8_metadata():
    """Metadata is compared as a value (the max rule), left out of the
    gradient's error norm, and a leaf there that is not a max is named."""
    state, loss = make_state(OPS["direct"])
    batch = batch_of(jax.random.key(1))
    diagnosis = jaxaccum.testing.diagnose(loss, state.params, batch, num_microbatches=4)
    assert diagnosis.matches, diagnosis
    rules = {error.path: error.rule for error in diagnosis.leaf_errors}
    meta = [path for path in rules if fp8_ops.OVERWRITE_WITH_GRADIENT in path]
    assert meta and all(rules[path] == "max" for path in meta)
    assert "(max): FP8 metadata" in str(diagnosis)
    jaxaccum.testing.assert_grads_match_full_batch(
        loss, state.params, batch, num_microbatches=4, rtol=RTOL, atol=ATOL
    )

    @jax.custom_vjp  # a "history" whose new value is its batch's mean
    def recorded(count, x):
        return count

    recorded.defvjp(lambda c, x: (c, x), lambda x, g: (jnp.mean(x), jnp.zeros_like(x)))

    def loss_with_mean(variables, x):
        count = variables[fp8_ops.OVERWRITE_WITH_GRADIENT]["count"]
        return jnp.mean(jnp.tanh(x @ variables["params"]["w"])) + 0 * recorded(count, x)

    variables = {
        "params": {"w": jnp.ones(3)},
        fp8_ops.OVERWRITE_WITH_GRADIENT: {"count": jnp.zeros(())},
    }
    # Rows of unit scale whose means differ by micro-batch: tanh away from
    # saturation, where 1 - tanh**2 would cancel to a few bits and any two
    # programs' roundings of tanh (the window's, the big batch's) drift apart.
    x = (
        0.5 * jax.random.normal(jax.random.key(0), (8, 3))
        + 0.1 * jnp.arange(8.0)[:, None]
    )
    diagnosis = jaxaccum.testing.diagnose(
        loss_with_mean, variables, x, num_microbatches=4
    )
    assert [cause.kind for cause in diagnosis.causes] == ["metadata"], diagnosis
    assert diagnosis.relative_error < RTOL  # the gradients match
    with pytest.raises(AssertionError, match="FP8 metadata: the max"):
        jaxaccum.testing.assert_grads_match_full_batch(
            loss_with_mean, variables, x, num_microbatches=4
        )


ROWS = 64


def option_loss(op, reduction, pad):
    """The FP8 MLP's loss under ``reduction``: per-example squared errors,
    their mean, sum or ``(weighted sum, weight)`` (weights 1..3 by row);
    with ``pad`` it takes the ``example_mask`` of the padded rows."""
    model = Fp8Mlp(op)

    def loss(variables, batch, example_mask=None):
        out = model.apply(variables, batch["x"])
        per_example = jnp.mean((out - batch["y"]) ** 2, -1)
        mask = 1.0 if example_mask is None else example_mask
        if reduction == "mean":
            return jnp.mean(per_example)
        if reduction == "sum":
            return jnp.sum(per_example * mask)
        return jnp.sum(per_example * batch["w"] * mask), jnp.sum(batch["w"] * mask)

    return loss if pad else (lambda variables, batch: loss(variables, batch))


@st.composite
def fp8_cases(draw):
    front = draw(st.sampled_from(["value_and_grad", "linen", "shard"]))
    reduction = draw(st.sampled_from(["mean", "sum", "weighted"]))
    pad = reduction != "mean" and front != "shard" and draw(st.booleans())
    split = 3 if pad else draw(st.sampled_from([1, 2, 4, "size16"]))
    masked = front != "shard" and split in (2, 4) and not pad and draw(st.booleans())
    return {
        "front": front,
        "reduction": reduction,
        "pad": pad,
        "split": split,
        "masked": masked,
        "active": draw(st.integers(1, split)) if masked else None,
        "remat": draw(st.booleans()),
        "report_stats": draw(st.booleans()),
    }


def accumulated_fn(case, loss):
    split = case["split"]
    kwargs = {
        "reduction": case["reduction"],
        "remat": case["remat"],
        "report_stats": case["report_stats"],
        "pad": case["pad"],
        "masked": case["masked"],
    }
    if not kwargs["pad"]:
        del kwargs["pad"]
    if not kwargs["masked"]:
        del kwargs["masked"]
    sizes = (
        {"microbatch_size": 16} if split == "size16" else {"num_microbatches": split}
    )
    if case["front"] == "linen":
        return jaxaccum.flax.linen_value_and_grad(loss, **sizes, **kwargs)
    if case["front"] == "shard":
        mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
        return jaxaccum.shard_value_and_grad(loss, **sizes, mesh=mesh, **kwargs)
    return jaxaccum.value_and_grad(loss, **sizes, **kwargs)


def fp8_case(front, reduction, split, **options):
    case = dict(front=front, reduction=reduction, split=split, pad=False)
    case.update(masked=False, active=None, remat=False, report_stats=False)
    return {**case, **options}


@settings(max_examples=8, derandomize=True, deadline=None)
@given(fp8_cases())
@example(fp8_case("linen", "weighted", 4, masked=True, active=3, remat=True))
@example(fp8_case("value_and_grad", "weighted", 3, pad=True, report_stats=True))
@example(fp8_case("value_and_grad", "mean", 4, masked=True, active=1))
@example(fp8_case("shard", "weighted", 2, remat=True, report_stats=True))
def test_fp8_metadata_over_the_options(case):
    """Over the front ends and options, the window's FP8 metadata is the big
    batch's (the active micro-batches' rows, with ``masked``): the input and
    kernel histories bitwise, the output-gradient ones and the gradients to
    float32 rounding: every micro-batch's cotangents are the big batch's
    (weighted, where its micro-batches weigh the same: otherwise they are
    within the imbalance, and FP8 rounds them differently)."""
    state, _ = make_state(OPS["direct"])
    loss = option_loss(OPS["direct"], case["reduction"], case["pad"])
    batch = batch_of(jax.random.key(7))
    num = 4 if case["split"] == "size16" else case["split"]
    batch["w"] = balanced_weights(num)
    rows = jnp.arange(ROWS) % num < (case["active"] or num)  # strided split
    reference_batch = jax.tree.map(lambda x: x[rows], batch)
    expected = big_batch(case["reduction"], state.params, reference_batch)
    accumulated = accumulated_fn(case, loss)
    call = {"active_microbatches": case["active"]} if case["masked"] else {}
    result = jax.jit(functools.partial(accumulated, **call))(state.params, batch)
    if case["report_stats"]:
        result, _ = result
    params, exact, rounded = split_metadata(result[1])
    params_e, exact_e, rounded_e = split_metadata(expected[1])
    chex.assert_trees_all_equal(exact, exact_e)
    chex.assert_trees_all_close(rounded, rounded_e, rtol=RTOL, atol=0)
    scale = 1.0 / int(rows.sum()) if case["reduction"] == "sum" else 1.0  # mean's
    chex.assert_trees_all_close(
        jax.tree.map(lambda g: g * scale, (result[0], params)),
        jax.tree.map(lambda g: g * scale, (expected[0], params_e)),
        rtol=RTOL,
        atol=ATOL,
    )


def balanced_weights(num):
    """Weights 1..3, constant over each block of ``num`` rows (a partial last
    block weighs 0): every micro-batch of the strided split weighs the same,
    so its share ``1 / (N w_k)`` is its big-batch share ``1 / W``."""
    rows = jnp.arange(ROWS)
    return (1.0 + (rows // num) % 3) * (rows < ROWS // num * num)


def big_batch(reduction, params, batch):
    """``jax.value_and_grad`` of the loss on the whole batch (weighted: of
    its weighted mean)."""
    loss = option_loss(OPS["direct"], reduction, pad=False)
    if reduction == "weighted":
        weighted = loss

        def loss(variables, batch):
            total, weight = weighted(variables, batch)
            return total / weight

    return jax.jit(jax.value_and_grad(loss))(params, batch)
