"""A property test of cached_value_and_grad's window per device (``mesh=``,
``data_axis=``) over its options, run inside cached_checks.py's process of 8
CPU devices (tests/test_cached_sharded.py).

Drawn (hypothesis, derandomized, a few examples for CI): the mesh (1-D of 8
with data_axis "data"; 4 x 2 with data_axis "data" or ("data", "model")),
``N`` in 1, 2, 4, given as ``num_microbatches`` or as ``microbatch_size``,
``has_aux`` (an integer and a float aux), ``key_argnums`` (dropout drawn in
the encoder from a key), the embeddings' output dtype (float32 or bfloat16)
and integer labels among the outputs (the loss's positives). Each result is
compared with the big batch, ``jax.value_and_grad`` of the loss on the whole
batch's outputs (with keys, on the outputs of the micro-batches the window
draws per device, composed in the batch's order), with chex and the
tolerances derived in tests/tolerances.py: RTOL and ATOL for float32
outputs, RTOL_BF16 and ATOL_BF16 for bfloat16 ones.
``JAXACCUM_CACHED_PROPERTY_EXAMPLES`` sets the number of examples.
"""

import collections
import functools
import math
import os
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, ATOL_BF16, RTOL, RTOL_BF16

import jaxaccum

BATCH, FEATURES, EMBED = 32, 6, 4
KEEP = 0.75  # dropout's keep probability
# name: (shape, axis names, data_axis)
MESHES = {
    "data8": ((8,), ("data",), "data"),
    "data4_model2": ((4, 2), ("data", "model"), "data"),
    "data4_model2_both": ((4, 2), ("data", "model"), ("data", "model")),
}
EXAMPLES = int(os.environ.get("JAXACCUM_CACHED_PROPERTY_EXAMPLES", "6"))


class Case(NamedTuple):
    """One drawn configuration of the window per device.

    Attributes:
      mesh: a key of MESHES.
      num_microbatches: ``N`` per device.
      by_size: whether ``N`` is given as ``microbatch_size=B / N``.
      has_aux: whether the loss returns ``(value, aux)``.
      keys: whether a key (``key_argnums=2``) draws the encoder's dropout.
      dtype: the embeddings' output dtype, "float32" or "bfloat16".
      labels: whether integer labels are among the outputs.
    """

    mesh: str
    num_microbatches: int
    by_size: bool
    has_aux: bool
    keys: bool
    dtype: str
    labels: bool


CASES = st.builds(
    Case,
    mesh=st.sampled_from(sorted(MESHES)),
    num_microbatches=st.sampled_from((1, 2, 4)),
    by_size=st.booleans(),
    has_aux=st.booleans(),
    keys=st.booleans(),
    dtype=st.sampled_from(("float32", "bfloat16")),
    labels=st.booleans(),
)


def inputs():
    keys = jax.random.split(jax.random.key(3), 5)
    params = {
        "image": jax.random.normal(keys[0], (FEATURES, EMBED)) / FEATURES**0.5,
        "text": jax.random.normal(keys[1], (FEATURES, EMBED)) / FEATURES**0.5,
        "log_scale": jnp.asarray(0.5),
    }
    batch = {
        "image": jax.random.normal(keys[2], (BATCH, FEATURES)),
        "text": jax.random.normal(keys[3], (BATCH, FEATURES)),
        "label": jax.random.randint(keys[4], (BATCH,), 0, 4),
    }
    return params, batch


@functools.cache
def encode_for(dtype, labels):
    def encode(params, batch, *key):
        image = jnp.tanh(batch["image"] @ params["image"])
        if key:
            keep = jax.random.bernoulli(key[0], KEEP, image.shape)
            image = jnp.where(keep, image, 0.0) / KEEP
        text = jnp.tanh(batch["text"] @ params["text"])
        outputs = {"image": image.astype(dtype), "text": text.astype(dtype)}
        return {**outputs, "label": batch["label"]} if labels else outputs

    return encode


@functools.cache
def loss_for(labels, has_aux):
    def loss(params, outputs, *key):
        """InfoNCE over the batch (one label's examples positives of each
        other, else each image its own text), plus a term that weighs each
        example by its row, so that outputs out of the batch's order move it."""
        del key
        image = outputs["image"].astype(jnp.float32)
        text = outputs["text"].astype(jnp.float32)
        size = image.shape[0]
        logits = jnp.exp(params["log_scale"]) * image @ text.T
        if labels:
            positive = outputs["label"][:, None] == outputs["label"][None, :]
        else:
            positive = jnp.eye(size, dtype=bool)
        matched = jax.nn.logsumexp(jnp.where(positive, logits, -jnp.inf), axis=1)
        position = jnp.arange(size) / size
        value = jnp.mean(jax.nn.logsumexp(logits, axis=1) - matched) + jnp.mean(
            position * jnp.sum(image * text, axis=-1)
        )
        if has_aux:
            return value, {"pairs": jnp.sum(positive), "scale": jnp.max(logits)}
        return value

    return loss


def data_devices(case):
    shape, names, data_axis = MESHES[case.mesh]
    axes = (data_axis,) if isinstance(data_axis, str) else data_axis
    return math.prod(shape[names.index(axis)] for axis in axes)


def big_batch(case, params, batch, key):
    """The contract: the loss on the whole batch's outputs, jax.value_and_grad.
    With keys, the outputs are those of the micro-batches the window runs:
    device ``d``'s key folded with ``d`` then split per micro-batch (kept
    at N = 1), micro-batch ``k`` its rows ``k, k + N, ...``, put back in the
    batch's order."""
    encode = encode_for(case.dtype, case.labels)
    loss = loss_for(case.labels, case.has_aux)
    if not case.keys:
        whole = jax.value_and_grad(
            lambda p, b: loss(p, encode(p, b)), has_aux=case.has_aux
        )
        return jax.jit(whole)(params, batch)
    devices, num = data_devices(case), case.num_microbatches
    local = BATCH // devices

    def composed(params):
        pieces, rows = [], []
        for device in range(devices):
            device_key = jax.random.fold_in(key, device)
            keys = [device_key] if num == 1 else jax.random.split(device_key, num)
            for index in range(num):
                micro_rows = device * local + np.arange(index, local, num)
                micro = jax.tree.map(lambda x, r=micro_rows: x[r], batch)
                pieces.append(encode(params, micro, keys[index]))
                rows.append(micro_rows)
        order = np.argsort(np.concatenate(rows))
        outputs = jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *pieces)
        return loss(params, outputs, key)

    return jax.jit(jax.value_and_grad(composed, has_aux=case.has_aux))(params)


def check_case(case):
    """The window per device of ``case`` against the big batch."""
    shape, names, data_axis = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names)
    split = (
        {"microbatch_size": BATCH // case.num_microbatches}
        if case.by_size
        else {"num_microbatches": case.num_microbatches}
    )
    step = jaxaccum.cached_value_and_grad(
        encode_for(case.dtype, case.labels),
        loss_for(case.labels, case.has_aux),
        mesh=mesh,
        data_axis=data_axis,
        has_aux=case.has_aux,
        **({"key_argnums": 2} if case.keys else {}),
        **split,
    )
    params, batch = inputs()
    key = jax.random.key(11)
    args = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P(data_axis))),
        *((key,) if case.keys else ()),
    )
    got = jax.jit(step)(*args)
    want = big_batch(case, params, batch, key)
    low = case.dtype == "bfloat16"
    chex.assert_trees_all_close(
        got,
        want,
        rtol=RTOL_BF16 if low else RTOL,
        atol=ATOL_BF16 if low else ATOL,
        custom_message=str(case),
    )


def check_property():
    """Runs the property test; returns what its examples drew."""
    drawn: collections.Counter = collections.Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(CASES)
    def matches_big_batch(case):
        check_case(case)
        drawn.update(f"{field}={value}" for field, value in case._asdict().items())

    matches_big_batch()
    return f"{EXAMPLES} examples drew {dict(sorted(drawn.items()))}"
