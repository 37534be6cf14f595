"""The window as a named axis on 8 CPU devices, run by sharded_checks.py:
``jaxaccum.value_and_grad(..., axis_name="window")`` under plain ``jit`` on a
batch sharded over the devices. Each micro-batch spans every device (the
strided split keeps each device's rows on it), so a BatchNorm's statistics
and an all_gather over the window meet across the whole batch: the big
batch's value and gradients (chex, RTOL and ATOL of tests/tolerances.py:
float32, the same sums in another order), on Auto and Explicit meshes; and
shard_value_and_grad refuses axis_name, saying what to use.
"""

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum

AXIS = "window"
BATCH = 64


def loss(params, batch, replicate=lambda x: x):
    """BatchNorm over the window, then in-batch negatives through
    all_gather and axis_index (tests/test_axis.py's models, smaller). On an
    Explicit mesh the gathered texts are resharded replicated, as the big
    batch's code would have to (both factors of a product sharded over one
    axis is an error there)."""
    hidden = batch["x"] @ params["image"]
    mean = lax.pmean(jnp.mean(hidden, 0), AXIS)
    var = lax.pmean(jnp.mean((hidden - mean) ** 2, 0), AXIS)
    image = jnp.tanh((hidden - mean) * lax.rsqrt(var + 1e-5))
    texts = lax.all_gather(jnp.tanh(batch["y"] @ params["text"]), AXIS, tiled=True)
    texts = replicate(texts)
    rows = image.shape[0]
    labels = lax.axis_index(AXIS) * rows + jnp.arange(rows)
    log_probs = jax.nn.log_softmax(2.0 * image @ texts.T)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def big_batch(params, batch):
    """The same loss on the whole batch with no axis: BatchNorm over all
    rows, every row against every text."""
    hidden = batch["x"] @ params["image"]
    mean = jnp.mean(hidden, 0)
    var = jnp.mean((hidden - mean) ** 2, 0)
    image = jnp.tanh((hidden - mean) * lax.rsqrt(var + 1e-5))
    texts = jnp.tanh(batch["y"] @ params["text"])
    return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(2.0 * image @ texts.T)))


def problem():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "image": jax.random.normal(keys[0], (6, 4)) / 2,
        "text": jax.random.normal(keys[1], (6, 4)) / 2,
    }
    batch = {
        "x": jax.random.normal(keys[2], (BATCH, 6)),
        "y": jax.random.normal(keys[3], (BATCH, 6)),
    }
    return params, batch


def check_under_jit(axis_type: str, num_microbatches: int) -> str:
    params, batch = problem()
    want = jax.value_and_grad(big_batch)(params, batch)
    types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
    mesh = jax.make_mesh((8,), ("data",), axis_types=types)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    replicate = (
        (lambda x: jax.sharding.reshard(x, P())) if axis_type == "explicit" else None
    )
    fun = loss if replicate is None else lambda p, b: loss(p, b, replicate)
    step = jax.jit(jaxaccum.value_and_grad(fun, num_microbatches, axis_name=AXIS))
    with jax.set_mesh(mesh):
        got = step(params, sharded)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
    return f"N={num_microbatches} on 8 devices ({axis_type}): the big batch's"


def check_shard_refuses() -> str:
    try:
        jaxaccum.shard_value_and_grad(loss, 2, axis_name=AXIS)
    except TypeError as error:
        assert "under jit" in str(error), str(error)
        return str(error)
    raise AssertionError("shard_value_and_grad took axis_name")


CHECKS = {
    "axis_name_auto_n4": lambda: check_under_jit("auto", 4),
    "axis_name_explicit_n2": lambda: check_under_jit("explicit", 2),
    "axis_name_shard_refuses": check_shard_refuses,
}
