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
        with pytest.raises(ValueError, match=f"active_microbatches={bad}"):
            step(w, x, active_microbatches=bad)


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
