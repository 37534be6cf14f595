"""The window as a named axis (``axis_name=``): ``fun`` written for data
parallelism (BatchNorm with ``axis_name``, ``all_gather`` for in-batch
negatives, ``psum`` of counts) runs over the micro-batches one at a time, its
collectives meeting across the whole window: the big batch's numbers.

The big batch is ``jax.vmap(fun, axis_name=...)`` over one member holding
the whole batch (a collective over one member is the whole batch's
reduction). The claim is that value up to rounding: the same sums in another
order. In float64 that is within 1e-12 (the issue's figure; float64 rounding,
``2**-53`` per operation over sums of at most 64 terms, is below 1e-14); a
real mistake (micro-batch statistics, a positive given to the wrong column,
the running averages updated N times) moves the result by 1e-2 and more
(``test_micro_batch_statistics_are_far_off`` shows how far).
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jaxaccum

FLOAT64_TOL = 1e-12
BATCH = 16
AXIS = "window"


def float64(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


class BatchNormMLP(nn.Module):
    """Two BatchNorms over the window's axis and a residual."""

    axis_name: str | None = AXIS

    @nn.compact
    def __call__(self, x, train=True):
        dense = dict(param_dtype=x.dtype, dtype=x.dtype)
        norm = dict(
            use_running_average=not train,
            axis_name=self.axis_name,
            param_dtype=x.dtype,
            dtype=x.dtype,
        )
        h = nn.tanh(nn.BatchNorm(**norm)(nn.Dense(8, **dense)(x)))
        h = nn.BatchNorm(**norm)(h + nn.Dense(8, **dense)(h))
        return nn.Dense(1, **dense)(nn.relu(h))[:, 0]


def mlp_problem(dtype=jnp.float64, axis_name=AXIS):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (BATCH, 3), dtype)
    batch = {"x": x, "y": jax.random.normal(keys[1], (BATCH,), dtype)}
    model = BatchNormMLP(axis_name)
    variables = model.init(keys[2], x, train=False)
    variables = jax.tree.map(lambda a: a.astype(dtype), variables)

    def loss(params, batch, stats):
        out, updates = model.apply(
            {"params": params, "batch_stats": stats},
            batch["x"],
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

    return loss, variables["params"], batch, variables["batch_stats"]


def big_batch(fun, *args, batch_argnum=1, has_aux=True):
    """``jax.value_and_grad`` of ``fun`` on the whole batch as the one member
    of the axis."""

    def whole(params, *rest):
        call = [params, *rest]
        call[batch_argnum] = jax.tree.map(lambda a: a[None], call[batch_argnum])
        axes = [None] * len(call)
        axes[batch_argnum] = 0
        out = jax.vmap(fun, in_axes=tuple(axes), axis_name=AXIS)(*call)
        return jax.tree.map(lambda a: a[0], out)

    return jax.value_and_grad(whole, has_aux=has_aux)(*args)


def clip_loss(params, batch):
    """In-batch negatives written for data parallelism: every row against
    the whole window's other tower, the positive found by axis_index."""
    image = jnp.tanh(batch["x"] @ params["image"])
    text = jnp.tanh(batch["y"] @ params["text"])
    texts = lax.all_gather(text, AXIS, tiled=True)
    logits = params["scale"] * image @ texts.T
    rows = image.shape[0]
    labels = lax.axis_index(AXIS) * rows + jnp.arange(rows)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def moe_loss(params, batch):
    """A task loss plus the MoE balance term N_E sum_i f_i P_i over the
    window: f from psum'd counts, P from pmean'd router probabilities."""
    logits = batch["x"] @ params["image"]
    experts = logits.shape[-1]
    chosen = jax.nn.one_hot(jnp.argmax(logits, -1), experts, dtype=logits.dtype)
    fraction = lax.psum(jnp.sum(chosen, 0), AXIS) / lax.psum(logits.shape[0], AXIS)
    probability = lax.pmean(jnp.mean(jax.nn.softmax(logits), 0), AXIS)
    return jnp.mean(logits**2) + experts * jnp.sum(fraction * probability)


def tower_problem(dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(1), 4)
    params = {
        "image": jax.random.normal(keys[0], (3, 4), dtype),
        "text": jax.random.normal(keys[1], (3, 4), dtype),
        "scale": jnp.asarray(2.0, dtype),
    }
    batch = {
        "x": jax.random.normal(keys[2], (BATCH, 3), dtype),
        "y": jax.random.normal(keys[3], (BATCH, 3), dtype),
    }
    return params, batch


def assert_close(got, want, tol, name):
    errors = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, want)
    worst = max(jax.tree.leaves(errors))
    assert worst <= tol, f"{name}: {worst:.3g} from the big batch (tol {tol})"


@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_linen_batchnorm_is_the_big_batchs(num_microbatches):
    """Value, every gradient leaf and the running averages (updated once a
    window, from the window's statistics) within 1e-12 in float64."""
    with jax.enable_x64():
        loss, params, batch, stats = mlp_problem()
        (want_value, want_stats), want_grads = big_batch(
            loss, params, batch, stats, has_aux=True
        )
        step = jaxaccum.value_and_grad(
            loss, num_microbatches, axis_name=AXIS, state_argnums=2
        )
        (value, grads), new_stats = jax.jit(step)(params, batch, stats)
        assert_close(value, want_value, FLOAT64_TOL, "value")
        assert_close(grads, want_grads, FLOAT64_TOL, "gradients")
        assert_close(new_stats, want_stats, FLOAT64_TOL, "running averages")


def test_micro_batch_statistics_are_far_off():
    """Without the axis, BatchNorm normalises each micro-batch by its own
    statistics (plain accumulation): the gradient is another model's."""
    with jax.enable_x64():
        loss, params, batch, stats = mlp_problem()
        _, want_grads = big_batch(loss, params, batch, stats)
        plain_loss, *_ = mlp_problem(axis_name=None)
        step = jaxaccum.value_and_grad(plain_loss, 8, state_argnums=2)
        (_, grads), _ = step(params, batch, stats)
        error = optax_norm_diff(grads, want_grads)
        assert error > 1e-2, error


def optax_norm_diff(a, b):
    import optax

    return float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)))


@pytest.mark.parametrize("loss", [clip_loss, moe_loss], ids=["all_gather", "psum"])
@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_batch_coupled_losses_are_the_big_batchs(loss, num_microbatches):
    """In-batch negatives through all_gather and axis_index, and a psum'd
    balance term: within 1e-12 of the big batch in float64."""
    with jax.enable_x64():
        params, batch = tower_problem()
        want = big_batch(loss, params, batch, has_aux=False)
        step = jaxaccum.value_and_grad(loss, num_microbatches, axis_name=AXIS)
        assert_close(jax.jit(step)(params, batch), want, FLOAT64_TOL, loss.__name__)


@pytest.mark.parametrize("num_microbatches", [2, 8])
def test_float32_within_rounding(num_microbatches):
    """float32: within 1e-5 of the big batch, relative to each leaf."""
    params, batch = tower_problem(jnp.float32)
    want = big_batch(clip_loss, params, batch, has_aux=False)
    got = jax.jit(jaxaccum.value_and_grad(clip_loss, num_microbatches, axis_name=AXIS))(
        params, batch
    )
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_collective_over_the_axis_is_the_plain_window():
    """A loss with no collective over the axis runs today's window: the same
    compiled program, so the same numbers bit for bit."""
    params, batch = tower_problem(jnp.float32)

    def mean_loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ params["image"]) ** 2)

    plain = jax.jit(jaxaccum.value_and_grad(mean_loss, 4))
    named = jax.jit(jaxaccum.value_and_grad(mean_loss, 4, axis_name=AXIS))
    chex.assert_trees_all_equal(named(params, batch), plain(params, batch))
    assert named.lower(params, batch).as_text() == plain.lower(params, batch).as_text()


def _nnx_model():
    from flax import nnx

    rngs = nnx.Rngs(0)
    kw = dict(param_dtype=jnp.float64, dtype=jnp.float64)
    return nnx.Sequential(
        nnx.Linear(3, 8, rngs=rngs, **kw),
        nnx.BatchNorm(8, axis_name=AXIS, rngs=rngs, **kw),
        jnp.tanh,
        nnx.Linear(8, 1, rngs=rngs, **kw),
    )


@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_nnx_batchnorm_is_the_big_batchs(num_microbatches):
    """nnx.BatchNorm(axis_name=...) through nnx_value_and_grad: the value,
    the gradients and the model's running averages are the big batch's."""
    from flax import nnx

    import jaxaccum.flax

    with jax.enable_x64():
        _, batch = tower_problem()

        def loss(model, batch):
            return jnp.mean((model(batch["x"])[:, 0] - batch["y"][:, 0]) ** 2)

        model = _nnx_model()
        big_model = nnx.clone(model)

        def whole(model, batch):
            one = jax.tree.map(lambda a: a[None], batch)
            return nnx.vmap(loss, in_axes=(None, 0), axis_name=AXIS)(model, one)[0]

        want_value, want_grads = nnx.value_and_grad(whole)(big_model, batch)
        step = jaxaccum.flax.nnx_value_and_grad(loss, num_microbatches, axis_name=AXIS)
        value, grads = nnx.jit(step)(model, batch)
        assert_close(value, want_value, FLOAT64_TOL, "value")
        assert_close(
            nnx.to_pure_dict(grads), nnx.to_pure_dict(want_grads), FLOAT64_TOL, "grads"
        )
        stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        want_stats = nnx.to_pure_dict(nnx.state(big_model, nnx.BatchStat))
        assert_close(stats, want_stats, FLOAT64_TOL, "running averages")


@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_equinox_batchnorm_under_the_per_example_vmap(num_microbatches):
    """eqx.nn.BatchNorm with ("batch", "window"), called under the
    per-example jax.vmap: the psum over (0, "window") meets across the
    window. Value, gradients and the new state are the big batch's."""
    import equinox as eqx

    import jaxaccum.equinox

    with jax.enable_x64():
        _, batch = tower_problem()
        keys = jax.random.split(jax.random.key(2), 2)
        linear = eqx.nn.Linear(3, 4, key=keys[0], dtype=jnp.float64)
        norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
            4, axis_name=("batch", AXIS), mode="ema", dtype=jnp.float64
        )
        model = (linear, norm)

        def loss(model, batch, state):
            linear, norm = model
            hidden = jax.vmap(linear)(batch["x"])
            out, state = jax.vmap(
                norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )(hidden, state)
            return jnp.mean((out[:, 0] - batch["y"][:, 0]) ** 2), state

        def whole(model, batch, state):
            one = jax.tree.map(lambda a: a[None], batch)
            out = eqx.filter_vmap(
                loss, in_axes=(None, 0, None), out_axes=(0, None), axis_name=AXIS
            )(model, one, state)
            return out[0][0], out[1]

        (want_value, want_state), want_grads = eqx.filter_value_and_grad(
            whole, has_aux=True
        )(model, batch, state)
        step = jaxaccum.equinox.filter_value_and_grad(
            loss, num_microbatches, axis_name=AXIS, state_argnums=2
        )
        (value, grads), new_state = eqx.filter_jit(step)(model, batch, state)
        assert_close(value, want_value, FLOAT64_TOL, "value")
        assert_close(
            eqx.filter(grads, eqx.is_inexact_array),
            eqx.filter(want_grads, eqx.is_inexact_array),
            FLOAT64_TOL,
            "grads",
        )
        assert_close(
            eqx.filter(new_state, eqx.is_inexact_array),
            eqx.filter(want_state, eqx.is_inexact_array),
            FLOAT64_TOL,
            "state",
        )


def layer_scan_loss(params, batch):
    """Residual layers in a lax.scan, a BatchNorm over the window in each:
    the scan's body is cut at each layer's collective."""

    def layer(h, weight):
        mean = lax.pmean(jnp.mean(h, 0), AXIS)
        var = lax.pmean(jnp.mean((h - mean) ** 2, 0), AXIS)
        normed = (h - mean) * lax.rsqrt(var + 1e-5)
        return h + jnp.tanh(normed @ weight), jnp.mean(normed)

    h, means = lax.scan(layer, batch["x"] @ params["image"], params["layers"])
    return jnp.mean(h**2) + jnp.sum(means)


@pytest.mark.parametrize("num_microbatches", [1, 2, 8])
def test_a_layer_scan_with_batchnorm_inside(num_microbatches):
    """lax.scan over layers (flax.linen.scan's and Equinox's layer scans
    lower to it) with a BatchNorm over the window in its body: exact."""
    with jax.enable_x64():
        params, batch = tower_problem()
        params["layers"] = jax.random.normal(jax.random.key(5), (3, 4, 4)) / 2
        want = big_batch(layer_scan_loss, params, batch, has_aux=False)
        step = jaxaccum.value_and_grad(
            layer_scan_loss, num_microbatches, axis_name=AXIS
        )
        assert_close(jax.jit(step)(params, batch), want, FLOAT64_TOL, "layer scan")


def _loop_psum(params, batch):
    def body(carry):
        i, h = carry
        return i + 1, h + lax.psum(jnp.mean(h), AXIS)

    _, h = lax.while_loop(lambda c: c[0] < 3, body, (0, batch["x"]))
    return jnp.mean(h)


def _cond_psum(params, batch):
    x = batch["x"] @ params["image"]
    return jnp.mean(
        lax.cond(params["scale"] > 0, lambda x: lax.psum(x, AXIS), lambda x: x, x)
    )


@jax.custom_vjp
def _custom(x):
    return lax.psum(x, AXIS)


_custom.defvjp(lambda x: (_custom(x), None), lambda _, g: (g,))


def _custom_vjp_psum(params, batch):
    return jnp.mean(_custom(batch["x"] @ params["image"]))


def _ppermute(params, batch):
    x = batch["x"] @ params["image"]
    return jnp.mean(lax.ppermute(x, AXIS, [(0, 1), (1, 0)]) * x)


def _psum_scatter(params, batch):
    x = batch["x"] @ params["image"]
    return jnp.mean(lax.psum_scatter(x, AXIS, tiled=True))


@pytest.mark.parametrize(
    ("loss", "named"),
    [
        (_loop_psum, "while_loop"),
        (_cond_psum, "cond"),
        (_custom_vjp_psum, "custom_vjp"),
        (_ppermute, "ppermute over the window"),
        (_psum_scatter, "over the window's axis 'window' is not supported"),
    ],
    ids=["while_loop", "cond", "custom_vjp", "ppermute", "psum_scatter"],
)
def test_collectives_it_cannot_compute_are_refused_by_name(loss, named):
    params, batch = tower_problem(jnp.float32)
    step = jaxaccum.value_and_grad(loss, 2, axis_name=AXIS)
    with pytest.raises(TypeError, match=named):
        step(params, batch)


def test_bad_axis_options_are_refused_when_built():
    with pytest.raises(TypeError, match="axis_name must be hashable"):
        jaxaccum.value_and_grad(clip_loss, 2, axis_name=["window"])
    with pytest.raises(ValueError, match="axis_name='window' with pad"):
        jaxaccum.value_and_grad(clip_loss, 2, axis_name=AXIS, pad=True, reduction="sum")
    with pytest.raises(ValueError, match="axis_name='window' with masked"):
        jaxaccum.value_and_grad(clip_loss, 2, axis_name=AXIS, masked=True)
    with pytest.raises(TypeError, match="does not take axis_name: the schedule"):
        jaxaccum.pipeline_value_and_grad(clip_loss, clip_loss, 2, axis_name=AXIS)
    with pytest.raises(TypeError, match="does not take axis_name: the loss already"):
        jaxaccum.cached_value_and_grad(clip_loss, clip_loss, 2, axis_name=AXIS)
    # A window spread over calls cannot meet over an axis (typed None there).
    with pytest.raises(TypeError, match="MultiSteps takes no axis_name .* calls"):
        jaxaccum.MultiSteps(optax.sgd(0.1), 2, axis_name=AXIS)  # type: ignore
    with pytest.raises(TypeError, match="accumulate takes no axis_name .* calls"):
        jaxaccum.accumulate(optax.sgd(0.1), 2, axis_name=AXIS)  # type: ignore


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_a_recomputed_segment_draws_the_same_bits(num_microbatches):
    """Keys in key_argnums are split per micro-batch as the core splits
    them; the backward recomputes each segment and must draw the masks its
    forward drew. The gradient of sum(mask * w) is the sum of the masks, a
    small integer in each entry: exact in any order, so the gradient equals
    the forward's masks (returned as aux) bit for bit."""
    rows, width = BATCH // num_microbatches, 4

    def loss(weights, batch, key):
        mask = jax.random.bernoulli(key, 0.5, (rows, width)).astype(jnp.float32)
        dropped = mask * weights * batch["x"][:, :1] ** 0
        coupled = lax.psum(jnp.sum(dropped), AXIS)  # a cut: segments recompute
        return jnp.sum(dropped) + 0.0 * coupled, mask

    weights = jnp.ones((rows, width))
    _, batch = tower_problem(jnp.float32)
    step = jaxaccum.value_and_grad(
        loss,
        num_microbatches,
        axis_name=AXIS,
        key_argnums=2,
        has_aux=True,
        reduction="sum",
        aux_reduction="stack",
    )
    (_, masks), grads = jax.jit(step)(weights, batch, jax.random.key(7))
    chex.assert_trees_all_equal(grads, jnp.sum(masks, axis=0))
    assert 0 < float(jnp.mean(masks)) < 1  # the masks drop something


def _coupled_loss(params, batch, key, *, reduction, has_aux, dropout):
    """BatchNorm over the window, then in-batch negatives through
    all_gather; per-example weights for the weighted reduction."""
    hidden = batch["x"] @ params["image"]
    mean = lax.pmean(jnp.mean(hidden, 0), AXIS)
    var = lax.pmean(jnp.mean((hidden - mean) ** 2, 0), AXIS)
    image = jnp.tanh((hidden - mean) * lax.rsqrt(var + 1e-5))
    if dropout:
        keep = jax.random.bernoulli(key, 0.75, image.shape)
        image = jnp.where(keep, image / 0.75, 0.0)
    texts = lax.all_gather(jnp.tanh(batch["y"] @ params["text"]), AXIS, tiled=True)
    rows = image.shape[0]
    labels = lax.axis_index(AXIS) * rows + jnp.arange(rows)
    log_probs = jax.nn.log_softmax(params["scale"] * image @ texts.T)
    per_example = -jnp.take_along_axis(log_probs, labels[:, None], axis=1)[:, 0]
    if reduction == "weighted":
        loss = (jnp.sum(per_example * batch["w"]), jnp.sum(batch["w"]))
    else:
        loss = jnp.mean(per_example) if reduction == "mean" else jnp.sum(per_example)
    aux = {"norm": jnp.mean(image**2), "rows": per_example}
    return (loss, aux) if has_aux else loss


def _vmapped_reference(
    loss, params, batch, key, num, reduction, aux_reduction, layout="strided"
):
    """The contract: jax.vmap(loss, axis_name) over the N micro-batches
    (strided, or contiguous blocks), the reduction applied to their results."""
    if layout == "strided":
        micro = jaxaccum.split_batch(batch, num)
    else:
        micro = jax.tree.map(lambda x: x.reshape(num, -1, *x.shape[1:]), batch)
    keys = jax.random.split(key, num) if num > 1 else key[None]

    def window(params):
        out = jax.vmap(loss, in_axes=(None, 0, 0), axis_name=AXIS)(params, micro, keys)
        value, aux = out if isinstance(out[1], dict) else (out, None)
        if reduction == "weighted":
            total = jnp.sum(value[0]) / jnp.sum(value[1])
        else:
            total = jnp.mean(value) if reduction == "mean" else jnp.sum(value)
        return total, aux

    (value, aux), grads = jax.value_and_grad(window, has_aux=True)(params)
    if aux is not None:
        by_row = aux["rows"] if layout == "contiguous" else aux["rows"].T
        rows = by_row.reshape(-1)
        norm = aux["norm"]
        aux = {
            "norm": jnp.mean(norm) if aux_reduction == "mean" else norm[-1],
            "rows": rows,
        }
        return (value, aux), grads
    return value, grads


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    num=st.sampled_from([1, 2, 4, 8]),
    by_size=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "weighted"]),
    has_aux=st.booleans(),
    aux_reduction=st.sampled_from(["mean", "last"]),
    dropout=st.booleans(),
    accum_dtype=st.sampled_from([jnp.float32, None]),
    unroll=st.sampled_from([1, 2, True]),
    remat=st.sampled_from([False, True, jax.checkpoint_policies.dots_saveable]),
    layout=st.sampled_from(["strided", "contiguous"]),
)
def test_property_any_options_are_the_vmapped_window(
    num,
    by_size,
    reduction,
    has_aux,
    aux_reduction,
    dropout,
    accum_dtype,
    unroll,
    remat,
    layout,
):
    """Over the options, the window equals jax.vmap(fun, axis_name) over
    its micro-batches with the options' reduction (float64, 1e-12)."""
    with jax.enable_x64():
        params, batch = tower_problem()
        batch["w"] = jnp.arange(BATCH, dtype=jnp.float64) % 3
        key = jax.random.key(11)

        def loss(params, batch, key):
            return _coupled_loss(
                params,
                batch,
                key,
                reduction=reduction,
                has_aux=has_aux,
                dropout=dropout,
            )

        options = dict(
            axis_name=AXIS,
            key_argnums=2,
            reduction=reduction,
            has_aux=has_aux,
            aux_reduction={"norm": aux_reduction, "rows": "concat"},
            accum_dtype=accum_dtype,
            unroll=unroll,
            remat=remat,
            axis_layout=layout,
        )
        size = {"microbatch_size": BATCH // num} if by_size else {}
        step = jaxaccum.value_and_grad(
            loss, None if by_size else num, **size, **options
        )
        got = jax.jit(step)(params, batch, key)
        want = _vmapped_reference(
            loss, params, batch, key, num, reduction, aux_reduction, layout
        )
        assert_close(got, want, FLOAT64_TOL, str(options))


def _benchmark():
    """benchmarks/axis.py: its models are the figures' (issue 67)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
    import axis

    return axis


def _mlp_problem(width, batch_size, blocks):
    params = [
        (jnp.zeros((width, 4 * width)), jnp.zeros((4 * width, width)))
        for _ in range(blocks)
    ]
    batch = {"x": jnp.zeros((batch_size, width)), "y": jnp.zeros((batch_size, width))}
    return params, batch


@pytest.mark.parametrize(("every", "bound"), [(8, 0.12), (1, 0.5)])
def test_memory_keeps_the_values_that_cross_a_cut(every, bound):
    """The issue's figure, compiled (nothing runs): 8 residual blocks of
    width 512 (hidden 2048) at B = 4096, N = 16 hold at most 0.12x the full
    batch's temporaries with a BatchNorm before every 8th block, 0.5x with
    one before every block: the window keeps BatchNorm's inputs, not the
    activations."""
    bench = _benchmark()
    params, batch = _mlp_problem(512, 4096, 8)
    full = bench.temp_bytes(
        jax.value_and_grad(bench.mlp_loss(every, False)), params, batch
    )
    named = bench.temp_bytes(
        jaxaccum.value_and_grad(bench.mlp_loss(every, True), 16, axis_name=AXIS),
        params,
        batch,
    )
    assert named <= bound * full, f"{named / full:.3f}x the full batch's"


def _flops_over_plain(make_loss, params, batch, num=4):
    """The window's FLOPs over the axis (``make_loss(True)``) against plain
    accumulation's (``make_loss(False)``: micro-batch statistics), ``num``
    micro-batches, counted on unrolled programs without CSE (XLA counts a
    loop body once)."""
    bench = _benchmark()
    plain, named = (
        bench.counted(
            jaxaccum.value_and_grad(make_loss(window), num, unroll=True, **options),
            params,
            batch,
        )
        for window, options in ((False, {}), (True, {"axis_name": AXIS}))
    )
    return named / plain


@pytest.mark.parametrize("every", [8, 1])
def test_flops_are_one_recomputed_forward(every):
    """At most 1.40x plain accumulation's FLOPs (the same blocks with
    micro-batch statistics); the ratio does not depend on the size."""
    bench = _benchmark()
    ratio = _flops_over_plain(
        functools.partial(bench.mlp_loss, every), *_mlp_problem(64, 256, 8)
    )
    assert ratio <= 1.40, f"{ratio:.3f}x plain accumulation's"


def test_a_batchnorm_after_a_convolution_does_not_rerun_it():
    """The backward reads what crosses a collective from where the window
    stacked it: with a BatchNorm after every convolution (every convolution's
    output crosses), nothing but elementwise work (the normalisations, the
    ReLUs) is recomputed, so the window's FLOPs are at most 1.05x plain
    accumulation's (recomputing each segment, as a checkpointed scan does,
    measured 1.31x)."""
    bench = _benchmark()
    params = bench.cnn_params((4, 8), jax.random.key(0))
    batch = {"image": jnp.zeros((16, 8, 8, 3)), "label": jnp.zeros(16, int)}
    loss = functools.partial(bench.cnn_loss, True)
    ratio = _flops_over_plain(loss, params, batch, num=2)
    assert ratio <= 1.05, f"{ratio:.3f}x plain accumulation's"


def test_clip_gathered_holds_at_most_125_percent_of_the_cached_windows():
    """The all_gather form of CLIP against cached_value_and_grad with the
    blockwise loss (B = 2048, N = 16): at most 1.25x its temporaries, and
    the same result (float32 rounding)."""
    bench = _benchmark()  # puts benchmarks/ on the path first
    import cached

    params = cached.init(jax.random.key(0), 512)
    keys = jax.random.split(jax.random.key(1), 2)
    batch = {
        tower: jax.random.normal(key, (2048, cached.FEATURES)) / 4
        for tower, key in zip(cached.TOWERS, keys, strict=True)
    }
    gathered = jaxaccum.value_and_grad(bench.clip_gathered, 16, axis_name=AXIS)
    by_cache = jaxaccum.cached_value_and_grad(
        cached.encode, cached.clip(jaxaccum.losses.softmax_contrastive), 16
    )
    temps = [bench.temp_bytes(f, params, batch) for f in (gathered, by_cache)]
    assert temps[0] <= 1.25 * temps[1], f"{temps[0] / temps[1]:.3f}x cached's"
    # The same sums of up to B = 2048 terms in two orders: each within
    # B * 2**-24 (relative to the sum of the terms' magnitudes) of the exact
    # value, so within twice that of each other.
    tol = 2 * 2048 * 2.0**-24
    chex.assert_trees_all_close(
        jax.jit(gathered)(params, batch),
        jax.jit(by_cache)(params, batch),
        rtol=tol,
        atol=tol,
    )


def test_plan_compiles_the_window_over_the_axis():
    """plan(axis_name=...) compiles the real program, so its figures count
    the values kept across the cuts: each row's temporaries are those of
    value_and_grad(axis_name=...) at its N."""
    bench = _benchmark()
    params, batch = _mlp_problem(128, 1024, 4)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    loss = bench.mlp_loss(1, True)
    result = jaxaccum.plan(
        loss, params, batch, memory_budget="1GiB", candidates=[4, 8], axis_name=AXIS
    )
    for row in result.rows:
        step = jaxaccum.value_and_grad(loss, row.num_microbatches, axis_name=AXIS)
        assert row.temp_bytes == bench.temp_bytes(step, params, batch)


def test_collectives_inside_jit_and_checkpoint_are_cut():
    """A BatchNorm inside a jitted and a checkpointed function of the loss:
    the calls are inlined into the cut, exact in float64."""

    @jax.jit
    def normalized(h):
        mean = lax.pmean(jnp.mean(h, 0), AXIS)
        return h - mean

    @jax.checkpoint
    def scaled(h):
        return h * lax.rsqrt(lax.pmean(jnp.mean(h**2, 0), AXIS) + 1e-5)

    def loss(params, batch):
        hidden = scaled(normalized(batch["x"] @ params["image"]))
        return jnp.mean(jnp.tanh(hidden) ** 2)

    with jax.enable_x64():
        params, batch = tower_problem()
        want = big_batch(loss, params, batch, has_aux=False)
        step = jaxaccum.value_and_grad(loss, 4, axis_name=AXIS)
        assert_close(jax.jit(step)(params, batch), want, FLOAT64_TOL, "jit, remat")
