"""cached_value_and_grad: a loss that sees the whole batch equals the big
batch's ``jax.value_and_grad``, one micro-batch at a time.

The claim is the big batch's value and gradient up to rounding: the same
sums in another order (the pullbacks summed over micro-batches, then the
loss's direct part added). In float64 that is within 1e-12 of the big batch
(the issue's figure; float64 rounding, ``2**-53`` per operation over the
tests' sums of at most 64 terms, is below 1e-14); in float32 within 1e-5
normwise per leaf (``tests/tolerances.py``'s ``RTOL``, 1.5e-5 per
coordinate, bounds each coordinate; a norm is at most as far off as its
largest coordinate relative to it). A real mistake (a micro-batch's
cotangent given to another, the temperature counted N times, fresh dropout
in pass 2) moves the gradient by 1e-2 and more.
"""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cached_models import (
    BATCH,
    FEATURES,
    assert_normwise_close,
    big_batch,
    clip_loss,
    encode,
    float64,
    normalized,
    relative_errors,
    tower,
    towers,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import ATOL, RTOL

import jaxaccum

FLOAT64_TOL = 1e-12
FLOAT32_NORMWISE_TOL = 1e-5


@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_float64_equals_the_big_batch(num_microbatches):
    with float64():
        params, batch = towers(jnp.float64)
        step = jaxaccum.cached_value_and_grad(encode, clip_loss, num_microbatches)
        got = jax.jit(step)(params, batch)
        want = jax.jit(big_batch(encode, clip_loss))(params, batch)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(got))
        chex.assert_trees_all_close(got, want, rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
        assert_normwise_close(got, want, FLOAT64_TOL)


@pytest.mark.parametrize("num_microbatches", [2, 8, BATCH])
def test_float32_within_rounding_and_the_temperature_counted_once(num_microbatches):
    params, batch = towers()
    step = jaxaccum.cached_value_and_grad(encode, clip_loss, num_microbatches)
    got = jax.jit(step)(params, batch)
    want = jax.jit(big_batch(encode, clip_loss))(params, batch)
    assert_normwise_close(got, want, FLOAT32_NORMWISE_TOL)
    # The temperature's gradient is the loss's own, once: N times it (as a
    # loop that runs the whole-batch loss per micro-batch gives) is far off.
    direct = want[1]["log_scale"]
    assert abs(direct) > 1e-2, direct
    assert abs(got[1]["log_scale"] - direct) <= FLOAT32_NORMWISE_TOL * abs(direct)


def test_in_batch_negatives_are_lost_by_plain_accumulation():
    """The reason for the two passes: the same loss accumulated by
    value_and_grad scores each example against B/N - 1 negatives only."""
    params, batch = towers()
    want = big_batch(encode, clip_loss)(params, batch)
    naive = jax.jit(
        jaxaccum.value_and_grad(lambda p, b: clip_loss_at(p, encode(p, b)), 4)
    )
    with pytest.raises(AssertionError):
        assert_normwise_close(naive(params, batch), want, 1e-2)


def clip_loss_at(params, outputs):
    """clip_loss on a batch of any size (the naive window's micro-batches)."""
    image, text = normalized(outputs["image"]), normalized(outputs["text"])
    logits = jnp.exp(params["log_scale"]) * image @ text.T
    labels = jnp.arange(image.shape[0])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_has_aux_returns_the_loss_aux_on_the_whole_batch():
    def loss_with_aux(params, outputs):
        return clip_loss(params, outputs), {"rows": outputs["image"].shape[0]}

    params, batch = towers()
    step = jaxaccum.cached_value_and_grad(encode, loss_with_aux, 4, has_aux=True)
    (value, aux), grads = jax.jit(step)(params, batch)
    (want_value, want_aux), want_grads = big_batch(encode, loss_with_aux, has_aux=True)(
        params, batch
    )
    assert aux == want_aux == {"rows": BATCH}
    assert_normwise_close((value, grads), (want_value, want_grads), 1e-5)


def test_several_argnums_and_a_loss_only_argument():
    """The encoder's parameters and a bias the loss alone uses (argument 2),
    both differentiated; a non-differentiated argument passed to both."""

    def encode_with(params, batch, bias, shift):
        del bias
        return {"image": tower(params["image"], batch["image"]) + shift}

    def loss_with(params, outputs, bias, shift):
        del params, shift
        scores = outputs["image"] @ outputs["image"].T + bias
        return jnp.mean(jax.nn.log_sigmoid(-scores))

    params, batch = towers()
    args = (params, batch, jnp.asarray(-1.5), jnp.asarray(0.25))
    step = jaxaccum.cached_value_and_grad(encode_with, loss_with, 4, argnums=(0, 2))
    got = jax.jit(step)(*args)
    want = big_batch(encode_with, loss_with, argnums=(0, 2))(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    # The text tower and temperature are unused: zero, like the big batch's.
    assert_normwise_close(
        (got[0], got[1][0]["image"], got[1][1]),
        (want[0], want[1][0]["image"], want[1][1]),
        FLOAT32_NORMWISE_TOL,
    )


NUM_EXPERTS = 4


def router_encode(params, batch):
    """An MoE router's per-example outputs: its probabilities and the one-hot
    expert each example is dispatched to (top-1)."""
    probs = jax.nn.softmax(batch["image"] @ params["router"])
    dispatched = jax.nn.one_hot(jnp.argmax(probs, axis=-1), NUM_EXPERTS)
    return {"probs": probs, "dispatched": dispatched}


def balance_loss(params, outputs):
    """The load-balancing term N_E * sum_i f_i * P_i: f_i the fraction of the
    batch dispatched to expert i, P_i its mean router probability."""
    del params
    fraction = jnp.mean(outputs["dispatched"], axis=0)
    mean_prob = jnp.mean(outputs["probs"], axis=0)
    return NUM_EXPERTS * jnp.sum(fraction * mean_prob)


def test_moe_balance_term_over_the_whole_batch_is_exact_and_per_microbatch_is_not():
    _, batch = towers()
    router = jax.random.normal(jax.random.key(11), (FEATURES, NUM_EXPERTS))
    params = {"router": router}
    want = big_batch(router_encode, balance_loss)(params, batch)
    step = jaxaccum.cached_value_and_grad(router_encode, balance_loss, 8)
    assert_normwise_close(jax.jit(step)(params, batch), want, FLOAT32_NORMWISE_TOL)
    # The per-micro-batch term (MaxText's per-sequence, value_and_grad's
    # mean over micro-batches) is another objective: value and gradient move.
    naive = jaxaccum.value_and_grad(
        lambda p, b: balance_loss(p, router_encode(p, b)), 8
    )
    errors = relative_errors(jax.jit(naive)(params, batch), want)
    assert min(jax.tree.leaves(errors)) > 1e-2, errors


def test_refusals_name_the_leaf_the_sizes_and_the_fix():
    params, batch = towers()
    with pytest.raises(ValueError, match="not divisible by num_microbatches=3"):
        jaxaccum.cached_value_and_grad(encode, clip_loss, 3)(params, batch)

    def pooled_encode(params, batch):
        outputs = encode(params, batch)
        return {**outputs, "mean": jnp.mean(outputs["image"], axis=0)}

    with pytest.raises(ValueError, match=r"output outputs\['mean'\] has shape \(4,\)"):
        jaxaccum.cached_value_and_grad(pooled_encode, clip_loss, 2)(params, batch)

    def scale_encode(params, batch):
        return {**encode(params, batch), "scale": params["log_scale"]}

    with pytest.raises(ValueError, match=r"outputs\['scale'\] has shape \(\)"):
        jaxaccum.cached_value_and_grad(scale_encode, clip_loss, 1)(params, batch)


def test_a_batch_n_does_not_divide_is_not_told_to_pad():
    """The hint names only options cached_value_and_grad takes (issue 66, 8):
    it refuses pad= and reduction= by name."""
    params, batch = towers()
    for size in ({"num_microbatches": 3}, {"microbatch_size": 3}):
        step = jaxaccum.cached_value_and_grad(
            encode,
            clip_loss,
            size.get("num_microbatches"),
            **({} if "num_microbatches" in size else size),
        )
        with pytest.raises(ValueError, match="not divisible") as caught:
            step(params, batch)
        assert "pad" not in str(caught.value), str(caught.value)
        assert "reduction" not in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match="not divisible") as caught:
        jaxaccum.split_batch(jnp.arange(6), 4)  # split_batch has no pad either
    assert "pad=True" not in str(caught.value)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(jnp.int32, ()), (jnp.complex64, ()), (jnp.float32, (2,))],
    ids=["integer", "complex", "vector"],
)
@pytest.mark.parametrize("front_end", ["cached", "core"])
def test_a_loss_that_is_not_a_real_scalar_is_refused(front_end, dtype, shape):
    """An integer loss has zero gradients and a complex one its real part's:
    cached_value_and_grad took both silently (issue 66, 2); it refuses them
    with the core's message, as jax.value_and_grad does."""
    params, batch = towers()

    def bad_loss(params, outputs):
        value = clip_loss(params, outputs)
        return jnp.broadcast_to(value, shape).astype(dtype)

    if front_end == "cached":
        step = jaxaccum.cached_value_and_grad(encode, bad_loss, 2)
        args = (params, batch)
    else:
        step = jaxaccum.value_and_grad(
            lambda w, x: jnp.broadcast_to(jnp.mean(x @ w), shape).astype(dtype), 2
        )
        args = (jnp.ones(3), jnp.ones((4, 3)))
    with pytest.raises(TypeError, match="must return a (float|scalar) loss, got"):
        step(*args)


@pytest.mark.parametrize("front_end", ["cached", "core"])
@pytest.mark.parametrize("returned", ["scalar", "triple"])
def test_has_aux_without_a_pair_gets_the_cores_message(front_end, returned):
    """has_aux=True with a bare scalar or a 3-tuple gave Python's unpacking
    errors (issue 66, 7); every front end says what to return."""
    params, batch = towers()

    def loss(params, outputs):
        value = outputs if params is None else clip_loss(params, outputs)
        return value if returned == "scalar" else (value, {}, {})

    if front_end == "cached":
        step = jaxaccum.cached_value_and_grad(encode, loss, 2, has_aux=True)
        name = "loss"
    else:
        step = jaxaccum.value_and_grad(
            lambda w, x: loss(None, jnp.mean(x @ w)), 2, has_aux=True
        )
        params, batch = jnp.ones(3), jnp.ones((4, 3))
        name = "fun"
    wanted = f"With has_aux=True, {name} must return a pair \\(loss, aux\\); got "
    with pytest.raises(TypeError, match=wanted) as caught:
        step(params, batch)
    expected = "an array of shape ()" if returned == "scalar" else "a tuple of 3"
    assert expected in str(caught.value)


def test_mutable_state_is_refused_with_why():
    params, batch = towers()

    def batchnorm_encode(params, batch):
        outputs = encode(params, batch)
        stats = {"mean": jnp.mean(outputs["image"], axis=0)}
        return outputs, {"batch_stats": stats}

    with pytest.raises(ValueError, match="refuses an encoder with mutable state"):
        jaxaccum.cached_value_and_grad(batchnorm_encode, clip_loss, 2)(params, batch)
    with pytest.raises(TypeError, match="statistics would be each micro-batch's"):
        jaxaccum.cached_value_and_grad(encode, clip_loss, 2, state_argnums=2)


def test_options_without_meaning_and_misspelt_ones_are_refused():
    with pytest.raises(TypeError, match="does not take reduction: the loss sees"):
        jaxaccum.cached_value_and_grad(encode, clip_loss, 2, reduction="sum")
    with pytest.raises(TypeError, match="unknown keyword argument 'acum_dtype'"):
        jaxaccum.cached_value_and_grad(encode, clip_loss, 2, acum_dtype=None)
    with pytest.raises(ValueError, match="exactly one of num_microbatches"):
        jaxaccum.cached_value_and_grad(encode, clip_loss, 2, microbatch_size=8)


def test_compiled_once_whatever_n():
    """The encoder is traced once per pass, at any N, and a step compiles once."""
    params, batch = towers()
    traces = []

    def counted_encode(params, batch):
        traces.append(1)
        return encode(params, batch)

    counts = {}
    for num in (2, 8):
        traces.clear()
        step = jaxaccum.cached_value_and_grad(counted_encode, clip_loss, num)
        jax.jit(step).lower(params, batch)
        counts[num] = len(traces)
    assert counts == {2: 2, 8: 2}, counts

    step = jaxaccum.cached_value_and_grad(encode, clip_loss, 4)
    jitted = jax.jit(chex.assert_max_traces(step, n=1))
    jitted(params, batch)
    other_params, other_batch = towers(seed=1)
    jitted(other_params, other_batch)


def test_the_step_shows_its_own_signature_not_the_loss():
    """The step takes the batch where loss takes the encoder's outputs, so it
    does not advertise loss's signature (as functools.wraps(loss) did)."""
    for options in ({}, {"mesh": jax.make_mesh((1,), ("data",))}):
        step = jaxaccum.cached_value_and_grad(encode, clip_loss, 2, **options)
        assert not hasattr(step, "__wrapped__"), options
        assert list(inspect.signature(step).parameters) == ["args"], options


def biased_loss(params, outputs, bias):
    """A SigLIP-style pairwise loss with a learnable bias (argument 2)."""
    image, text = normalized(outputs["image"]), normalized(outputs["text"])
    logits = jnp.exp(params["log_scale"]) * image @ text.T + bias
    signs = 2 * jnp.eye(image.shape[0]) - 1
    return -jnp.mean(jax.nn.log_sigmoid(signs * logits))


def biased_loss_with_aux(params, outputs, bias):
    return biased_loss(params, outputs, bias), jnp.sum(outputs["image"])


def biased_encode(params, batch, bias):
    del bias
    return {
        "image": tower(params["image"], batch["image"]),
        "text": tower(params["text"], batch["text"]),
    }


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    split=st.sampled_from(
        [("num", 1), ("num", 2), ("num", 8), ("size", 4), ("size", 1)]
    ),
    argnums=st.sampled_from([0, (0, 2), (2, 0)]),
    has_aux=st.booleans(),
    accum_dtype=st.sampled_from([jnp.float32, None]),
    unroll=st.sampled_from([1, 2, True]),
)
def test_property_any_options_equal_the_big_batch(
    split, argnums, has_aux, accum_dtype, unroll
):
    params, batch = towers()
    batch = {"image": batch["image"][:8], "text": batch["text"][:8]}
    bias = jnp.asarray(-2.0)
    loss = biased_loss_with_aux if has_aux else biased_loss
    kind, count = split
    options = {"num_microbatches": count} if kind == "num" else {}
    if kind == "size":
        options["microbatch_size"] = count
    step = jaxaccum.cached_value_and_grad(
        biased_encode,
        loss,
        argnums=argnums,
        has_aux=has_aux,
        accum_dtype=accum_dtype,
        unroll=unroll,
        **options,
    )
    got = jax.jit(step)(params, batch, bias)
    want = big_batch(biased_encode, loss, argnums, has_aux)(params, batch, bias)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


def test_bfloat16_outputs_meet_the_loss_and_its_cotangent_in_float32():
    """With a bfloat16 encoder the loss runs on its outputs cast up to
    accum_dtype (the values unchanged), so the loss and its backward to the
    outputs are float32's: its value is float32's rounding of the bfloat16
    encoder (measured 46x closer to float64 on the same numbers than a
    bfloat16 loss; asserted 4x, a bfloat16 loss rounds at 2**-9 an operation,
    float32 at 2**-24). accum_dtype=None keeps bfloat16 throughout."""
    params, batch = towers(jnp.bfloat16)
    seen_dtypes = []

    def loss(params, outputs):
        seen_dtypes.append(outputs["image"].dtype)
        return clip_loss(params, outputs)

    results = {}
    for accum_dtype in (jnp.float32, None):
        step = jaxaccum.cached_value_and_grad(encode, loss, 4, accum_dtype=accum_dtype)
        results[accum_dtype] = jax.jit(step)(params, batch)
    assert seen_dtypes == [jnp.float32, jnp.bfloat16], seen_dtypes
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(results[None][1]))
    with float64():
        wide = jax.tree.map(lambda x: np.asarray(x, np.float64), (params, batch))
        wide[1]["label"] = np.asarray(batch["label"])
        reference = big_batch(encode, clip_loss)(*wide)
        value_errors = [
            relative_errors(jnp.asarray(got[0], jnp.float64), reference[0])
            for got in results.values()
        ]
    assert results[jnp.float32][0].dtype == jnp.float32
    assert results[None][0].dtype == jnp.bfloat16
    assert value_errors[0] < value_errors[1] / 4, value_errors


def test_pass_one_keeps_nothing_but_the_outputs():
    """Pass 1 writes each micro-batch's outputs into their rows of the
    batch's outputs in place, so where the loss dominates (the B x B logits
    against towers of one layer) the window holds the full batch's
    temporaries and at most one micro-batch's outputs besides (a tower's
    B / N x D, the scan's slice): no second copy of the whole batch's
    outputs to put them in the batch's order (which stacking them did:
    1.125x the full batch's here)."""
    rows, features, dim, num = 1024, 256, 128, 8
    keys = jax.random.split(jax.random.key(0), 4)
    towers = ("image", "text")
    params = {
        t: jax.random.normal(k, (features, dim)) / 16
        for t, k in zip(towers, keys[:2], strict=True)
    }
    batch = {
        t: jax.random.normal(k, (rows, features))
        for t, k in zip(towers, keys[2:], strict=True)
    }

    def encode_both(params, batch):
        return {t: jnp.tanh(batch[t] @ params[t]) for t in towers}

    def loss(params, outputs):
        return jaxaccum.losses.softmax_contrastive(
            outputs["image"], outputs["text"], 10.0
        )

    def temps(step):
        compiled = jax.jit(step).lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full = temps(jax.value_and_grad(lambda p, b: loss(p, encode_both(p, b))))
    cached = temps(jaxaccum.cached_value_and_grad(encode_both, loss, num))
    slices = len(towers) * rows // num * dim * 4
    assert cached <= full + slices, (cached, full, slices)
