"""jaxaccum.flax: Linen and NNX models, their state threaded through the scan.

Tolerances (float32): RTOL, ATOL (tests/tolerances.py) against the full batch,
and against N sequential micro-batch passes for stateful models (BatchNorm, dropout).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import ATOL, ATOL64, RTOL, RTOL64

import jaxaccum
import jaxaccum.flax

# Float32 rounding bounds, derived in tests/tolerances.py.
BATCH_SIZE = 16


def cross_entropy(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def make_batch(shape=(BATCH_SIZE, 6), seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {
        "x": jax.random.normal(kx, shape),
        "y": jax.random.randint(ky, (shape[0],), 0, 3),
    }


def microbatches(batch, num_microbatches):
    """The micro-batches jaxaccum uses, in order (strided split)."""
    stacked = jaxaccum.split_batch(batch, num_microbatches)
    return [jax.tree.map(lambda x, k=k: x[k], stacked) for k in range(num_microbatches)]


def mean_of(trees):
    return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


# Linen


class BatchNormMLP(nn.Module):
    """Dense -> BatchNorm -> Dropout -> Dense."""

    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(x))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(3)(x)


class GroupNormCNN(nn.Module):
    """Conv -> GroupNorm -> mean-pooled Dense: every example on its own."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3))(x)))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


def linen_bn_loss(model):
    def loss(variables, batch, rngs=None):
        logits, updates = model.apply(
            variables, batch["x"], mutable=["batch_stats"], rngs=rngs
        )
        return cross_entropy(logits, batch["y"]), updates

    return loss


def linen_sequential_reference(loss, variables, batch, num_microbatches, key=None):
    """Mean (loss, grads) of N sequential micro-batch passes, micro-batch k with
    dropout key split(key, N)[k], and the batch_stats they leave."""

    @jax.jit
    def micro_step(params, stats, micro, micro_key):
        rngs = None if micro_key is None else {"dropout": micro_key}
        (value, new), grads = jax.value_and_grad(
            lambda params: loss(
                {"params": params, "batch_stats": stats}, micro, rngs=rngs
            ),
            has_aux=True,
        )(params)
        return (value, grads), new["batch_stats"]

    keys = [None] * num_microbatches
    if key is not None:
        keys = list(jax.random.split(key, num_microbatches))
    stats, results = variables["batch_stats"], []
    for micro, micro_key in zip(
        microbatches(batch, num_microbatches), keys, strict=True
    ):
        result, stats = micro_step(variables["params"], stats, micro, micro_key)
        results.append(result)
    return mean_of(results), stats


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_linen_groupnorm_cnn_matches_full_batch(num_microbatches):
    model = GroupNormCNN()
    batch = make_batch((BATCH_SIZE, 6, 6, 2))
    variables = model.init(jax.random.key(1), batch["x"][:1])

    def loss(variables, batch):
        return cross_entropy(model.apply(variables, batch["x"]), batch["y"])

    accumulated = jax.jit(jaxaccum.flax.linen_value_and_grad(loss, num_microbatches))(
        variables, batch
    )
    full_loss, full_grads = jax.jit(jax.value_and_grad(loss))(variables, batch)
    chex.assert_trees_all_close(
        accumulated, (full_loss, full_grads["params"]), rtol=RTOL, atol=ATOL
    )


def test_linen_batchnorm_stats_equal_sequential_passes():
    num_microbatches = 4
    """batch_stats after a window = N sequential training-mode forward passes."""
    model = BatchNormMLP()
    batch = make_batch()
    variables = model.init(jax.random.key(1), batch["x"][:2], train=False)
    loss = linen_bn_loss(model)
    (value, grads), updates = jax.jit(
        jaxaccum.flax.linen_value_and_grad(
            loss, num_microbatches, mutable="batch_stats"
        )
    )(variables, batch)

    reference, stats = linen_sequential_reference(
        loss, variables, batch, num_microbatches
    )
    chex.assert_trees_all_close(updates, {"batch_stats": stats}, rtol=RTOL, atol=ATOL)
    # Each micro-batch is normalized with its own statistics.
    chex.assert_trees_all_close((value, grads), reference, rtol=RTOL, atol=ATOL)
    # The running mean moved: the test would catch state that is not carried.
    moved = jnp.abs(stats["BatchNorm_0"]["mean"]).max()
    assert moved > 1e-2, f"running mean barely moved ({moved:.3g})"


def test_linen_dropout_rngs_are_split_per_microbatch():
    num_microbatches = 4
    model = BatchNormMLP(dropout_rate=0.5)
    batch = make_batch()
    variables = model.init(jax.random.key(1), batch["x"][:2], train=False)
    loss = linen_bn_loss(model)
    key = jax.random.key(7)
    accumulate = jax.jit(
        jaxaccum.flax.linen_value_and_grad(
            loss, num_microbatches, mutable=["batch_stats"]
        )
    )
    result, updates = accumulate(variables, batch, rngs={"dropout": key})

    reference, stats = linen_sequential_reference(
        loss, variables, batch, num_microbatches, key
    )
    chex.assert_trees_all_close(result, reference, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_close(updates, {"batch_stats": stats}, rtol=RTOL, atol=ATOL)
    # Same key: bitwise the same window.
    chex.assert_trees_all_equal(
        accumulate(variables, batch, rngs={"dropout": key}), (result, updates)
    )


class TrainState(train_state.TrainState):
    batch_stats: dict


def test_linen_train_state_loop_compiles_once():
    num_microbatches, steps = 4, 20
    model = BatchNormMLP()
    batch = make_batch()
    variables = model.init(jax.random.key(1), batch["x"][:2], train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adam(1e-2),
    )
    # create() leaves step a Python int; as an array, the second call hits the
    # first call's dispatch-cache entry, so _cache_size counts compilations.
    state = state.replace(step=jnp.asarray(state.step))
    step_fn = jaxaccum.flax.linen_train_step(
        linen_bn_loss(model), num_microbatches, mutable="batch_stats"
    )
    step = jax.jit(chex.assert_max_traces(step_fn, n=1))
    losses = []
    for index in range(steps):
        state, loss = step(state, make_batch(seed=index % 2))
        losses.append(float(loss))
    assert step._cache_size() == 1, f"compiled {step._cache_size()} times"
    assert int(state.step) == steps  # one apply_gradients per window
    assert losses[-1] < 0.75 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    # batch_stats were stored back: they are no longer the initial ones.
    chex.assert_trees_all_equal_shapes(state.batch_stats, variables["batch_stats"])
    assert float(jnp.abs(state.batch_stats["BatchNorm_0"]["mean"]).max()) > 1e-2


def test_linen_train_step_with_aux_and_rngs():
    model = BatchNormMLP(dropout_rate=0.5)
    batch = make_batch()
    variables = model.init(jax.random.key(1), batch["x"][:2], train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(0.1),
    )

    def loss(variables, batch, rngs):
        (value, updates) = linen_bn_loss(model)(variables, batch, rngs)
        return (value, {"first": value}), updates

    step = jax.jit(
        jaxaccum.flax.linen_train_step(
            loss, 2, mutable="batch_stats", has_aux=True, aux_reduction="stack"
        )
    )
    new_state, (value, aux) = step(state, batch, rngs={"dropout": jax.random.key(0)})
    chex.assert_shape(aux["first"], (2,))
    chex.assert_trees_all_close(value, jnp.mean(aux["first"]), rtol=RTOL, atol=ATOL)
    assert int(new_state.step) == 1


def test_linen_errors_name_the_collection():
    model = BatchNormMLP()
    batch = make_batch()
    variables = model.init(jax.random.key(1), batch["x"][:2], train=False)
    with pytest.raises(ValueError, match=r"collections \['batch_stats'\].*mutable="):
        jaxaccum.flax.linen_value_and_grad(linen_bn_loss(model), 2, mutable="stats")(
            {**variables, "stats": {}}, batch
        )
    with pytest.raises(ValueError, match=r"no collection\(s\) \['cache'\]"):
        jaxaccum.flax.linen_value_and_grad(linen_bn_loss(model), 2, mutable="cache")(
            variables, batch
        )
    with pytest.raises(TypeError, match=r"\(out, updates\).*but mutable=\(\)"):
        jaxaccum.flax.linen_value_and_grad(linen_bn_loss(model), 2)(variables, batch)
    with pytest.raises(TypeError, match="sets state_argnums itself"):
        jaxaccum.flax.linen_value_and_grad(linen_bn_loss(model), 2, state_argnums=1)
    with pytest.raises(TypeError, match="mutable must name"):
        jaxaccum.flax.linen_value_and_grad(linen_bn_loss(model), 2, mutable=True)
    plain = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1)
    )
    step = jaxaccum.flax.linen_train_step(
        linen_bn_loss(model), 2, mutable="batch_stats"
    )
    with pytest.raises(AttributeError, match=r"no field\(s\) \['batch_stats'\]"):
        step(plain, batch)


# NNX


class MLP(nnx.Module):
    """Linear -> (LayerNorm | BatchNorm) -> Dropout -> Linear."""

    def __init__(self, norm: str = "layer", dropout_rate: float = 0.0, seed: int = 0):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.linear1 = nnx.Linear(6, 16, rngs=rngs)
        if norm == "layer":
            self.norm = nnx.LayerNorm(16, rngs=rngs)
        else:
            self.norm = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.linear1(x)))
        return self.linear2(self.dropout(x))


def nnx_loss(model, batch):
    return cross_entropy(model(batch["x"]), batch["y"])


def sequential_reference(model, batch, num_microbatches):
    """Mean loss and grads of N sequential nnx.value_and_grad passes, and the
    model after them."""
    model = nnx.clone(model)
    step = nnx.jit(nnx.value_and_grad(nnx_loss))
    results = [step(model, micro) for micro in microbatches(batch, num_microbatches)]
    return mean_of(results), model


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_nnx_layernorm_mlp_matches_full_batch(num_microbatches):
    model, batch = MLP("layer"), make_batch()
    accumulated = nnx.jit(jaxaccum.flax.nnx_value_and_grad(nnx_loss, num_microbatches))(
        model, batch
    )
    full = nnx.jit(nnx.value_and_grad(nnx_loss))(model, batch)
    chex.assert_trees_all_close(accumulated, full, rtol=RTOL, atol=ATOL)


def test_nnx_batchnorm_stats_equal_sequential_passes():
    num_microbatches = 4
    model, batch = MLP("batch"), make_batch()
    reference, reference_model = sequential_reference(model, batch, num_microbatches)
    accumulated = nnx.jit(jaxaccum.flax.nnx_value_and_grad(nnx_loss, num_microbatches))(
        model, batch
    )
    chex.assert_trees_all_close(accumulated, reference, rtol=RTOL, atol=ATOL)
    stats = nnx.state(model, nnx.BatchStat)
    chex.assert_trees_all_close(
        stats, nnx.state(reference_model, nnx.BatchStat), rtol=RTOL, atol=ATOL
    )
    moved = float(jnp.abs(model.norm.mean[...]).max())
    assert moved > 1e-2, f"running mean barely moved ({moved:.3g})"


def test_nnx_dropout_rng_advances_deterministically():
    num_microbatches = 4
    model, batch = MLP("layer", dropout_rate=0.5), make_batch()
    rerun_model = nnx.clone(model)
    reference, reference_model = sequential_reference(model, batch, num_microbatches)
    accumulate = nnx.jit(jaxaccum.flax.nnx_value_and_grad(nnx_loss, num_microbatches))

    first = accumulate(model, batch)
    # One draw per forward pass: the stream advanced once per micro-batch, and
    # the micro-batches drew what N sequential passes draw.
    assert int(model.dropout.rngs.count[...]) == num_microbatches
    chex.assert_trees_all_close(first, reference, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_equal(
        nnx.state(model, nnx.RngState), nnx.state(reference_model, nnx.RngState)
    )
    # Same model state: bitwise the same window.
    chex.assert_trees_all_equal(accumulate(rerun_model, batch), first)
    chex.assert_trees_all_equal(nnx.state(rerun_model), nnx.state(model))
    # The next window draws new masks.
    second = accumulate(model, batch)
    assert int(model.dropout.rngs.count[...]) == 2 * num_microbatches
    assert float(jnp.abs(second[0] - first[0])) > 1e-4


def test_nnx_optimizer_loop_compiles_once():
    num_microbatches, steps = 4, 20
    model = MLP("batch", dropout_rate=0.1)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def train_step(model, optimizer, batch):
        loss, grads = jaxaccum.flax.nnx_value_and_grad(nnx_loss, num_microbatches)(
            model, batch
        )
        optimizer.update(model, grads)
        return loss

    losses = [
        float(train_step(model, optimizer, make_batch(seed=index % 2)))
        for index in range(steps)
    ]
    assert int(optimizer.step[...]) == steps  # one optimizer step per window
    assert int(model.dropout.rngs.count[...]) == steps * num_microbatches
    assert losses[-1] < 0.75 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_nnx_under_jax_jit_with_aux():
    model = MLP("batch")
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def loss_with_aux(model, batch):
        logits = model(batch["x"])
        return cross_entropy(logits, batch["y"]), jnp.argmax(logits, -1)

    @jax.jit
    def train_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        (loss, predictions), grads = jaxaccum.flax.nnx_value_and_grad(
            loss_with_aux, 2, has_aux=True, aux_reduction="stack"
        )(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss, predictions

    batch = make_batch()
    for _ in range(3):
        state, loss, predictions = train_step(state, batch)
    assert train_step._cache_size() == 1
    chex.assert_shape(predictions, (2, BATCH_SIZE // 2))
    nnx.update((model, optimizer), state)
    assert int(optimizer.step[...]) == 3
    assert float(jnp.abs(model.norm.mean[...]).max()) > 1e-2


class Caching(nnx.Module):
    """Stores its activations in a new Variable: the model's state changes."""

    def __init__(self):
        self.linear = nnx.Linear(6, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        y = self.linear(x)
        self.activations = nnx.Intermediate(y)
        return y


def test_nnx_errors():
    batch = make_batch()
    with pytest.raises(ValueError, match=r"changed which Variables.*activations"):
        jaxaccum.flax.nnx_value_and_grad(nnx_loss, 2)(Caching(), batch)
    with pytest.raises(TypeError, match="Argument 2 is an NNX Rngs"):
        jaxaccum.flax.nnx_value_and_grad(lambda model, batch, rngs: 0.0, 2)(
            MLP(), batch, nnx.Rngs(0)
        )
    with pytest.raises(TypeError, match="sets batch_argnums itself"):
        jaxaccum.flax.nnx_value_and_grad(nnx_loss, 2, batch_argnums=0)


def test_nnx_window_the_scale_skips_leaves_the_batch_stats_as_they_were():
    """NNX writes the window's state into the model in place, so a window
    that was not finite wrote inf/NaN running statistics that
    select_if_finite on the parameters could not undo; every eval-mode
    forward was NaN after one overflow (issue 45, case 2). A skipped window
    leaves the carried state bitwise as it was; a finite one writes it."""
    model, batch = MLP("batch"), make_batch()
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    step = nnx.jit(jaxaccum.flax.nnx_value_and_grad(nnx_loss, 4, loss_scale=True))
    poisoned = {**batch, "x": batch["x"].at[5].set(jnp.inf)}
    _, report = step(model, poisoned, loss_scale=jaxaccum.dynamic_loss_scale())
    assert not bool(report.finite)
    chex.assert_trees_all_equal(nnx.state(model, nnx.BatchStat), before)
    _, report = step(model, batch, loss_scale=jaxaccum.dynamic_loss_scale())
    assert bool(report.finite)
    moved = float(jnp.abs(model.norm.mean[...] - before["norm"]["mean"][...]).max())
    assert moved > 1e-2, moved


@pytest.mark.parametrize("check", ["linen_diagnose", "nnx_diagnose"])
def test_the_checks_refuse_a_loss_scale_under_their_own_name(check):
    """linen_diagnose listed loss_scale among its options, then refused it
    under diagnose's name (issue 45)."""
    with pytest.raises(TypeError, match=rf"{check} does not take loss_scale"):
        getattr(jaxaccum.flax, check)(None, None, None, loss_scale=True)
    with pytest.raises(TypeError, match="unknown keyword") as info:
        getattr(jaxaccum.flax, check)(None, None, None, rduction="sum")
    assert "loss_scale" not in str(info.value)


# NNX over a named axis: the micro-batches share the model's state, and each
# draws from its own split of the RNG streams' keys (issue 72).

AXIS = "window"


class AxisDropoutNet(nnx.Module):
    """Linear -> BatchNorm over the window's axis -> tanh -> Dropout -> Linear,
    in float64; returns the logits and where dropout zeroed (tanh is never
    exactly 0, so that is the dropout mask)."""

    def __init__(self, rate=0.5):
        rngs = nnx.Rngs(0, dropout=1)
        kw = dict(param_dtype=jnp.float64, dtype=jnp.float64)
        self.linear1 = nnx.Linear(6, 16, rngs=rngs, **kw)
        self.norm = nnx.BatchNorm(16, axis_name=AXIS, rngs=rngs, **kw)
        self.dropout = nnx.Dropout(rate, rngs=rngs)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs, **kw)

    def __call__(self, x):
        hidden = self.dropout(jnp.tanh(self.norm(self.linear1(x))))
        return self.linear2(hidden), hidden == 0


def dropout_loss(model, batch):
    logits, dropped = model(batch["x"])
    return cross_entropy(logits, batch["y"]), dropped


def axis_dropout_step(num_microbatches, **options):
    """The window over the axis, the N masks stacked as aux."""
    return nnx.jit(
        jaxaccum.flax.nnx_value_and_grad(
            dropout_loss,
            num_microbatches,
            axis_name=AXIS,
            has_aux=True,
            aux_reduction="stack",
            **options,
        )
    )


def _micro_batches(batch, num_microbatches, layout):
    if layout == "strided":
        return jaxaccum.split_batch(batch, num_microbatches)
    return jax.tree.map(lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch)


def vmapped_dropout_reference(model, batch, num_microbatches, layout="strided"):
    """The contract: jax.vmap(loss, axis_name) over the N micro-batches (as
    ``axis_layout`` lays them out), micro-batch k's model holding
    jax.random.split(key, N)[k] for every stream's key, its other state the
    window's; the mean loss, the N masks, and the mean's gradients."""
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    keys, state = nnx.filter_state(state, nnx.RngKey, ...)
    micro_keys = jax.tree.map(  # the key itself for one micro-batch, as the core
        lambda key: (
            jax.random.split(key, num_microbatches)
            if num_microbatches > 1
            else key[None]
        ),
        keys,
    )

    def one(params, micro, micro_key):
        return dropout_loss(
            nnx.merge(graphdef, params, state, micro_key, copy=True), micro
        )

    def window(params):
        losses, masks = jax.vmap(one, in_axes=(None, 0, 0), axis_name=AXIS)(
            params, _micro_batches(batch, num_microbatches, layout), micro_keys
        )
        return jnp.mean(losses), masks

    return jax.jit(jax.value_and_grad(window, has_aux=True))(params)


def test_nnx_axis_dropout_draws_a_mask_per_microbatch():
    """Under axis_name the model's state is one value the micro-batches
    share; its RNG keys were too, and Dropout repeated one mask N times
    (issue 72). Each micro-batch now draws its own."""
    num_microbatches = 4
    with jax.enable_x64():
        (_, masks), _ = axis_dropout_step(num_microbatches)(
            AxisDropoutNet(), make_batch()
        )
    chex.assert_shape(masks, (num_microbatches, BATCH_SIZE // num_microbatches, 16))
    repeats = [
        (j, k)
        for j in range(num_microbatches)
        for k in range(j + 1, num_microbatches)
        if bool(jnp.all(masks[j] == masks[k]))
    ]
    assert not repeats, f"micro-batches {repeats} drew the same dropout mask"
    assert 0.2 < float(jnp.mean(masks)) < 0.8, float(jnp.mean(masks))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    num_microbatches=st.sampled_from([1, 2, 4]),
    rate=st.sampled_from([0.25, 0.5]),
    layout=st.sampled_from(["strided", "contiguous"]),
    remat=st.booleans(),
)
def test_nnx_axis_dropout_is_the_vmapped_window(num_microbatches, rate, layout, remat):
    """Over N, the dropout rate, the layout and remat (a property test), the
    value, the masks and the gradients are jax.vmap(loss, axis_name)'s over
    the micro-batches, micro-batch k's keys the k-th of their split
    (float64). The backward recomputes each micro-batch's segment: a segment
    drawing other bits than its forward would move the gradients by 1e-2 and
    more. Not bitwise: the window sums the micro-batches' losses and
    gradients in its own order, so they agree to float64 rounding
    (RTOL64, ATOL64)."""
    with jax.enable_x64():
        model, batch = AxisDropoutNet(rate), make_batch()
        want = vmapped_dropout_reference(model, batch, num_microbatches, layout)
        step = axis_dropout_step(num_microbatches, axis_layout=layout, remat=remat)
        got = step(model, batch)
    (value, masks), grads = got
    (want_value, want_masks), want_grads = want
    chex.assert_trees_all_equal(masks, want_masks)
    chex.assert_trees_all_close(
        (value, grads), (want_value, want_grads), rtol=RTOL64, atol=ATOL64
    )


def test_nnx_axis_keeps_the_keys_and_advances_the_counts_once():
    """The micro-batches advance the streams' counts alike: the window
    leaves what one forward pass leaves, and the keys as they were; so the
    next window draws new masks."""
    num_microbatches = 4
    with jax.enable_x64():
        model, batch = AxisDropoutNet(), make_batch()
        keys = jax.tree.map(jax.random.key_data, nnx.state(model, nnx.RngKey))
        one_pass = nnx.clone(model)
        nnx.vmap(lambda model, x: model(x), in_axes=(None, 0), axis_name=AXIS)(
            one_pass, batch["x"][None]
        )
        step = axis_dropout_step(num_microbatches)
        (_, first), _ = step(model, batch)
        chex.assert_trees_all_equal(
            nnx.state(model, nnx.RngCount), nnx.state(one_pass, nnx.RngCount)
        )
        assert int(model.dropout.rngs.count[...]) == 1
        chex.assert_trees_all_equal(
            jax.tree.map(jax.random.key_data, nnx.state(model, nnx.RngKey)), keys
        )
        (_, second), _ = step(model, batch)
    assert int(model.dropout.rngs.count[...]) == 2
    same = [k for k in range(num_microbatches) if bool(jnp.all(first[k] == second[k]))]
    assert not same, f"micro-batches {same} drew the first window's mask again"
