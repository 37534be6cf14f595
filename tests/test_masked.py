"""masked=True: one compiled program for every window of up to N micro-batches.

A window of k active micro-batches (laid out by pad_microbatches) equals
value_and_grad with k micro-batches on the unpadded batch. Tolerance: the same
micro-batches, of the same shape, summed in the same order (a skipped
micro-batch adds nothing), so only the loop's fusion differs around the
lax.cond, a few float32 ulp per op: rtol 1e-6 (8 ulp), atol 1e-6 near zero.
"""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from check_scripts import device_env

import jaxaccum

MAX, MICRO, FEATURES = 6, 4, 3
RTOL = ATOL = 1e-6


def mean_loss(w, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ w) ** 2), {
        "first": jnp.tanh(batch["x"][0] @ w)
    }


def weighted_loss(w, batch):
    losses = jnp.tanh(batch["x"] @ w) ** 2
    return (jnp.sum(losses * batch["mask"]), jnp.sum(batch["mask"])), {
        "first": jnp.tanh(batch["x"][0] @ w)
    }


def make_batch(num, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    size = num * MICRO
    return {
        "x": np.asarray(jax.random.normal(keys[0], (size, FEATURES))),
        "mask": np.asarray(jax.random.bernoulli(keys[1], 0.7, (size,)), np.float32),
    }


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
@pytest.mark.parametrize("aux_reduction", ["mean", "last", "sum"])
def test_k_active_equals_k_micro_batches(reduction, aux_reduction):
    loss = mean_loss if reduction == "mean" else weighted_loss
    options = dict(
        has_aux=True,
        reduction=reduction,
        aux_reduction=aux_reduction,
        report_stats=True,
    )
    masked = jax.jit(jaxaccum.value_and_grad(loss, MAX, masked=True, **options))
    w = jnp.array([0.3, -0.2, 0.5])
    for active in range(2, MAX + 1):
        batch = make_batch(active, seed=active)
        window = jaxaccum.pad_microbatches(batch, active, MAX)
        got, got_stats = masked(w, window, active_microbatches=active)
        want, want_stats = jaxaccum.value_and_grad(loss, active, **options)(w, batch)
        chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
        # Statistics count the active micro-batches only: the skipped ones
        # carry weight 0 and norm 0.
        assert got_stats.small_batch.shape == (MAX,)
        np.testing.assert_array_equal(got_stats.small_batch[active:], 0.0)
        chex.assert_trees_all_close(
            got_stats._replace(
                microbatch_grad_sq_norm=got_stats.microbatch_grad_sq_norm[:active],
                small_batch=got_stats.small_batch[:active],
                microbatch_finite=got_stats.microbatch_finite[:active],
            ),
            want_stats,
            # The estimators divide differences of these norms; see the
            # module docstring for the inputs' tolerance, relaxed 10x for the
            # conditioning of (B S_B - b S_b) on this data.
            rtol=10 * RTOL,
            atol=10 * ATOL,
        )


def test_one_compile_and_skipped_micro_batches_are_not_computed():
    calls = []
    traces = []

    def loss(w, batch):
        traces.append(1)
        jax.debug.callback(lambda: calls.append(1))
        return jnp.mean(batch["x"] @ w)

    step = jax.jit(jaxaccum.value_and_grad(loss, MAX, masked=True))
    w = jnp.ones(FEATURES)
    for active in (2, 3, 5, 6, 1):
        calls.clear()
        batch = jaxaccum.pad_microbatches(make_batch(active), active, MAX)
        jax.block_until_ready(step(w, batch, active_microbatches=active))
        assert len(calls) == active, (active, len(calls))
    # Traced once for the scan body and once for its output shapes, whatever
    # the number of active micro-batches.
    assert step._cache_size() == 1
    assert len(traces) <= 3, len(traces)


def test_active_microbatches_is_required_and_checked():
    step = jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), MAX, masked=True)
    w, x = jnp.ones(FEATURES), jnp.ones((MAX * MICRO, FEATURES))
    with pytest.raises(TypeError, match="active_microbatches"):
        step(w, x)
    for bad in (0, MAX + 1):
        with pytest.raises(
            ValueError, match=f"active_microbatches must be from 1 to {MAX}, got {bad}"
        ):
            step(w, x, active_microbatches=bad)
    for bad, shown in ((2.7, "got 2.7"), (True, "got True"), (jnp.ones(2), r"\(2,\)")):
        with pytest.raises(TypeError, match=f"must be an integer scalar.*{shown}"):
            step(w, x, active_microbatches=bad)


def test_microbatch_size_range_is_that_of_the_batch():
    """Issue 30, case 1: with microbatch_size, N comes from the batch (8 rows
    of 2: N = 4), and active_microbatches is checked against it."""
    step = jaxaccum.value_and_grad(
        lambda w, x: jnp.mean(x @ w), microbatch_size=2, masked=True
    )
    w, x = jnp.ones(2), jnp.arange(16.0).reshape(8, 2)
    for bad in (0, 5, 6):
        with pytest.raises(ValueError, match=f"from 1 to 4, got {bad}"):
            step(w, x, active_microbatches=bad)
    value, grads = step(w, x, active_microbatches=4)
    chex.assert_trees_all_close(
        (value, grads), jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 4)(w, x)
    )


def _loss_with_every_dtype(w, x):
    losses = jnp.tanh(x @ w) ** 2
    aux = {"mean": jnp.mean(losses), "count": jnp.sum(losses > 0), "any": x[0, 0] > 0}
    return jnp.mean(losses), aux


def test_traced_out_of_range_gives_no_plausible_number():
    """Under jit no error can be raised: a count outside 1..N (a Python int is
    traced too) gives NaN value, gradients, float aux and statistics, False
    finite flags and the most negative int in integer aux (issue 30, case 2).
    """
    step = jax.jit(
        jaxaccum.value_and_grad(
            _loss_with_every_dtype,
            microbatch_size=MICRO,
            masked=True,
            has_aux=True,
            aux_reduction={"mean": "mean", "count": "sum", "any": "last"},
            report_stats=True,
        )
    )
    w = jnp.array([0.3, -0.2, 0.5])
    window = make_batch(MAX)["x"]
    for bad in (0, -1, MAX + 1, MAX + 2, jnp.int32(MAX + 1)):
        ((value, aux), grads), stats = step(w, window, active_microbatches=bad)
        for name, leaf in {"value": value, "grads": grads, "aux": aux["mean"]}.items():
            assert np.all(np.isnan(leaf)), (bad, name, leaf)
        for name, field in stats._asdict().items():
            field = np.asarray(field)
            invalid = ~field if field.dtype == bool else np.isnan(field)
            assert np.all(invalid), (bad, name, field)
        assert aux["count"] == np.iinfo(np.int32).min, (bad, aux["count"])
        assert not aux["any"], bad
    # One program for Python ints (weakly typed), one for the int32 array.
    assert step._cache_size() == 2
    ((value, _), _), stats = step(w, window, active_microbatches=MAX)
    assert np.isfinite(value) and bool(stats.finite)


def test_one_micro_batch_window_is_checked_too():
    """N = 1 runs without a scan; a traced 0 still gives NaN, not its one
    micro-batch."""
    step = jax.jit(
        jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 1, masked=True)
    )
    value, grads = step(jnp.ones(2), jnp.ones((4, 2)), active_microbatches=0)
    assert np.isnan(value) and np.all(np.isnan(grads)), (value, grads)


def test_active_microbatches_without_masked_is_refused():
    """Issue 30, case 6: a loss with **kwargs would swallow it and every
    micro-batch would be averaged."""

    def loss(w, x, **kwargs):
        return jnp.mean(x @ w)

    for front_end in (jaxaccum.value_and_grad, jaxaccum.grad):
        step = front_end(loss, MAX)
        with pytest.raises(TypeError, match="built without masked=True"):
            step(jnp.ones(2), jnp.ones((MAX, 2)), active_microbatches=3)


def test_masked_under_equinox_filter_jit():
    """filter_jit binds the wrapped function's signature: it must name
    active_microbatches, for the core and the Equinox front end."""
    eqx = pytest.importorskip("equinox")
    import jaxaccum.equinox

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    batch = make_batch(2)["x"]
    window = jaxaccum.pad_microbatches(batch, 2, MAX)
    w = jnp.array([0.3, -0.2, 0.5])
    want = jaxaccum.value_and_grad(loss, 2)(w, batch)
    core = eqx.filter_jit(jaxaccum.value_and_grad(loss, MAX, masked=True))
    chex.assert_trees_all_close(
        core(w, window, active_microbatches=jnp.int32(2)), want, rtol=RTOL, atol=ATOL
    )
    model = eqx.nn.Linear(FEATURES, "scalar", use_bias=False, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.weight, model, w)
    step = eqx.filter_jit(
        jaxaccum.equinox.filter_value_and_grad(
            lambda m, x: loss(m.weight, x), MAX, masked=True
        )
    )
    value, grads = step(model, window, active_microbatches=jnp.int32(2))
    chex.assert_trees_all_close((value, grads.weight), want, rtol=RTOL, atol=ATOL)


def test_pad_microbatches_with_a_typed_key_leaf():
    """Typed keys have no zero: the empty micro-batches get valid keys."""
    batch = {
        "x": np.arange(8.0).reshape(4, 2),
        "key": jax.random.split(jax.random.key(0), 4),
    }
    window = jaxaccum.pad_microbatches(batch, 2, 3)
    assert window["key"].shape == (6,) and window["x"].shape == (6, 2)
    np.testing.assert_array_equal(
        jax.random.key_data(jaxaccum.split_batch(window, 3)["key"][:2]),
        jax.random.key_data(jaxaccum.split_batch(batch, 2)["key"]),
    )
    with pytest.raises(ValueError, match="num_microbatches=3 does not divide") as info:
        jaxaccum.pad_microbatches(batch, 3, 4)
    assert "pad=True" not in str(info.value)


def test_pad_microbatches_keeps_each_micro_batch():
    batch = {"x": np.arange(24.0).reshape(12, 2)}
    window = jaxaccum.pad_microbatches(batch, 3, 5)
    assert isinstance(window["x"], np.ndarray)
    micro = jaxaccum.split_batch(window, 5)["x"]
    np.testing.assert_array_equal(micro[:3], jaxaccum.split_batch(batch, 3)["x"])
    np.testing.assert_array_equal(micro[3:], 0.0)
    with pytest.raises(ValueError, match="above max_microbatches"):
        jaxaccum.pad_microbatches(batch, 6, 4)


EXPLICIT_MESH_CHECK = """
import jax, jax.numpy as jnp, numpy as np, chex
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxaccum

def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2), x[:, 0]

options = dict(has_aux=True, aux_reduction="stack")
mesh = jax.make_mesh((4,), ("data",))  # Explicit axes
x = np.random.RandomState(0).randn(32, 3).astype(np.float32)
with jax.set_mesh(mesh):
    window = jax.device_put(
        jaxaccum.pad_microbatches(x, 2, 4), NamedSharding(mesh, P("data"))
    )
    step = jax.jit(jaxaccum.value_and_grad(loss, 4, masked=True, **options))
    (value, aux), grads = step(jnp.ones(3), window, active_microbatches=2)
want = jaxaccum.value_and_grad(loss, 2, **options)(jnp.ones(3), jnp.asarray(x))
chex.assert_trees_all_close(((value, aux[:2]), grads), want, rtol=1e-6, atol=1e-6)
np.testing.assert_array_equal(aux[2:], 0.0)
"""


def test_masked_on_an_explicit_mesh():
    """On 4 devices with the batch sharded over Explicit axes, a skipped
    micro-batch's zeros are typed like the computed ones' (lax.cond needs
    both branches' shardings to match)."""
    process = subprocess.run(
        [sys.executable, "-c", EXPLICIT_MESH_CHECK],
        env=device_env(4),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
