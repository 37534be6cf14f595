"""cached_value_and_grad on a batch sharded over 8 CPU devices under plain
``jit`` (XLA's sharding propagation, an Auto mesh), run by test_cached_sharded.py in
its own process (``--xla_force_host_platform_device_count=8``).

Each check compares the sharded step with the single-device big batch's
``jax.value_and_grad`` (chex, RTOL and ATOL of tests/tolerances.py) and
reports the collectives XLA put in the compiled program, inside and outside
its loops. Under plain ``jit`` XLA all-reduces the replicated parameters'
gradient in each pass-2 iteration (the accumulator is replicated); one
reduction per step needs the window per device (``mesh=``, ``data_axis=``,
as ``shard_value_and_grad`` takes them): the ``mesh_*`` checks assert it
exact and count its collectives, nothing inside a loop, one all-gather of
the outputs and one all-reduce after the loop. ``MESH_ARGUMENT``: mesh= used
outside jax.set_mesh on a 2-D mesh and inside the caller's own shard_map
(tests/mesh_cases.py), and a property test of the window per device over its
options (tests/cached_mesh_property.py). Prints one JSON object,
``{check name: {"ok": bool, "detail": str}}``, as the last line of stdout.
"""

import functools
import sys

import cached_models as models
import chex
import jax
import jax.numpy as jnp
import mesh_cases
import numpy as np
from cached_mesh_property import check_property
from check_scripts import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum
from jaxaccum.testing import find_collectives

BATCH_SIZE = 64  # 8 rows per device; N = 8 leaves one per device and micro-batch
FEATURES, EMBED = 6, 4
CHECKS = [
    f"{axis_type}_data_sharded_n{num}"
    for axis_type in ("auto", "explicit")
    for num in (2, 8)
] + [
    "mesh_explicit_n1",
    "mesh_auto_n2",
    "mesh_explicit_n4",
    "mesh_2axes_n2",
    "mesh_keys_n2",
    "mesh_labels_aux_n2",
]
MESH_ARGUMENT = ["outside_set_mesh_2d", "inside_users_shard_map", "property_per_device"]
CHECKS += MESH_ARGUMENT


def encode(params, batch):
    return {
        "image": jnp.tanh(batch["image"] @ params["image"]),
        "text": jnp.tanh(batch["text"] @ params["text"]),
    }


def clip_loss(params, outputs):
    """CLIP's symmetric InfoNCE, written so that an Explicit mesh resolves
    every sharding: the positives from rows on the same devices, the texts
    gathered once for the B x B logits."""
    image, text = outputs["image"], outputs["text"]
    scale = jnp.exp(params["log_scale"])
    positive = scale * jnp.mean(jnp.sum(image * text, axis=-1))
    if jax.typeof(text).sharding.mesh.axis_types == (AxisType.Explicit,):
        text = jax.sharding.reshard(text, P())
    logits = scale * image @ text.T
    image_to_text = jnp.mean(jax.nn.logsumexp(logits, axis=1))
    text_to_image = jnp.mean(jax.nn.logsumexp(logits, axis=0))
    return (image_to_text + text_to_image) / 2 - positive


def ordered_loss(params, outputs):
    """clip_loss, plus a term that weighs each example by its row: a loss
    that sees the order of the rows (CLIP's is the same for any order of the
    examples), so outputs gathered out of the batch's order change it."""
    image, text = outputs["image"], outputs["text"]
    position = jnp.arange(image.shape[0]) / image.shape[0]
    return clip_loss(params, outputs) + jnp.mean(
        position * jnp.sum(image * text, axis=-1)
    )


def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "image": jax.random.normal(keys[0], (FEATURES, EMBED)) / FEATURES**0.5,
        "text": jax.random.normal(keys[1], (FEATURES, EMBED)) / FEATURES**0.5,
        "log_scale": jnp.asarray(1.0),
    }
    batch = {
        "image": jax.random.normal(keys[2], (BATCH_SIZE, FEATURES)),
        "text": jax.random.normal(keys[3], (BATCH_SIZE, FEATURES)),
    }
    return params, batch


def check_sharded(axis_type, num_microbatches):
    """The batch's rows over the 8 devices, the parameters replicated, on an
    Auto mesh (XLA propagates the shardings) or an Explicit one (the loss
    gathers what it needs)."""
    axis_types = (AxisType.Auto if axis_type == "auto" else AxisType.Explicit,)
    mesh = jax.make_mesh((8,), ("data",), axis_types=axis_types)
    params, batch = inputs()
    reference = jax.jit(jax.value_and_grad(lambda p, b: clip_loss(p, encode(p, b))))(
        params, batch
    )
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    placed = (jax.device_put(params, replicated), jax.device_put(batch, rows))
    step = jax.jit(
        jaxaccum.cached_value_and_grad(encode, clip_loss, num_microbatches),
        in_shardings=(replicated, rows),
    )
    with jax.set_mesh(mesh):
        compiled = step.lower(*placed).compile()
        out = compiled(*placed)
    chex.assert_trees_all_close(out, reference, rtol=RTOL, atol=ATOL)
    assert len(placed[1]["image"].sharding.device_set) == 8
    collectives = find_collectives(compiled)
    in_loop = [f"{c.op} {c.shapes}" for c in collectives if c.in_loop]
    # What the docs say of plain jit (why mesh= exists): XLA reduces the
    # replicated gradient sum inside pass 2's loop. If this fails, XLA got
    # better and the docstring's and the guide's sentence is stale.
    assert any(c.in_loop and "all-reduce" in c.op for c in collectives), in_loop
    return (
        f"{len(collectives)} collectives ("
        + ", ".join(sorted({c.op for c in collectives}))
        + f"), inside loops: {in_loop}"
    )


@functools.cache
def big_batch():
    params, batch = inputs()
    loss = jax.value_and_grad(lambda p, b: ordered_loss(p, encode(p, b)))
    return jax.jit(loss)(params, batch)


def check_per_device(layout, num_microbatches):
    """The window per device (mesh=, data_axis=): the big batch's value and
    gradient (the temperature's counted once, the outputs in the batch's
    order: ordered_loss), and in the compiled program
    no collective inside a loop, one all-gather (the outputs, both towers'
    side by side) and one all-reduce (the gradients, with the value) after
    the loop, nothing else."""
    if layout == "2axes":  # the batch over both axes of a 2 x 4 mesh
        shape, axes = (2, 4), ("replica", "data")
        mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * 2)
    else:
        kind = AxisType.Auto if layout == "auto" else AxisType.Explicit
        axes = ("data",)
        mesh = jax.make_mesh((8,), axes, axis_types=(kind,))
    params, batch = inputs()
    rows = NamedSharding(mesh, P(axes))
    placed = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, rows),
    )
    data_axis = axes if len(axes) > 1 else axes[0]
    # N = 4 given as its micro-batch size over all devices (2 rows a device).
    split = (
        {"microbatch_size": BATCH_SIZE // num_microbatches}
        if num_microbatches == 4
        else {"num_microbatches": num_microbatches}
    )
    step = jax.jit(
        jaxaccum.cached_value_and_grad(
            encode, ordered_loss, mesh=mesh, data_axis=data_axis, **split
        )
    )
    compiled = step.lower(*placed).compile()
    out = compiled(*placed)
    chex.assert_trees_all_close(out, big_batch(), rtol=RTOL, atol=ATOL)
    assert len(placed[1]["image"].sharding.device_set) == 8
    if num_microbatches > 1:
        assert " while(" in compiled.as_text(), "the micro-batch loops were unrolled"
    collectives = find_collectives(compiled)
    in_loop = [c for c in collectives if c.in_loop]
    assert not in_loop, f"collectives inside a loop: {in_loop}"
    ops = sorted(c.op for c in collectives)
    assert ops == ["all-gather", "all-reduce"], f"collectives: {collectives}"
    gather, reduce = sorted(collectives, key=lambda c: c.op)
    assert gather.shapes == (f"f32[{BATCH_SIZE},{2 * EMBED}]",), gather
    assert f"f32[{FEATURES},{EMBED}]" in reduce.shapes, reduce
    assert gather.group_size == reduce.group_size == 8, collectives
    return f"collectives: {[(c.op, c.shapes) for c in collectives]}"


def dropout_encode(params, batch, key):
    """encode with dropout on the image embedding, drawn from ``key``."""
    outputs = encode(params, batch)
    keep = jax.random.bernoulli(key, 0.6, outputs["image"].shape)
    return {**outputs, "image": jnp.where(keep, outputs["image"], 0.0) / 0.6}


def keyed_loss(params, outputs, key):
    del key
    return ordered_loss(params, outputs)


def check_keys_per_device(num_microbatches):
    """key_argnums with mesh=: the big batch's gradient with the masks the
    docstring gives (device d's key folded with d, then split per
    micro-batch, micro-batch k its rows k, k + N, ...), so pass 2 drew pass
    1's masks; a mask redrawn in pass 2 would move the gradient."""
    mesh = jax.make_mesh((8,), ("data",))
    params, batch = inputs()
    key = jax.random.key(7)
    local = BATCH_SIZE // 8

    def composed(params):
        pieces, rows = [], []
        for device in range(8):
            keys = jax.random.split(jax.random.fold_in(key, device), num_microbatches)
            for index in range(num_microbatches):
                micro_rows = device * local + np.arange(index, local, num_microbatches)
                micro = jax.tree.map(lambda x, r=micro_rows: x[r], batch)
                pieces.append(dropout_encode(params, micro, keys[index]))
                rows.append(micro_rows)
        order = np.argsort(np.concatenate(rows))
        outputs = jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *pieces)
        return ordered_loss(params, outputs)

    reference = jax.jit(jax.value_and_grad(composed))(params)
    step = jaxaccum.cached_value_and_grad(
        dropout_encode, keyed_loss, num_microbatches, key_argnums=2, mesh=mesh
    )
    placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
    out = jax.jit(step)(jax.device_put(params, NamedSharding(mesh, P())), placed, key)
    chex.assert_trees_all_close(out, reference, rtol=RTOL, atol=ATOL)
    unmasked = jax.jit(jax.value_and_grad(lambda p: ordered_loss(p, encode(p, batch))))
    moved = abs(float(unmasked(params)[0] - out[0]))
    assert moved > 1e-2, f"the masks changed the value by {moved} only"
    return f"value {float(out[0]):.6f}, {moved:.3f} from the unmasked one"


def check_labels_and_aux_per_device(num_microbatches):
    """With mesh=: integer outputs (labels) beside float ones (hard
    negatives), an aux of an int and a bool: the big batch's, the outputs
    gathered once per dtype, the value, aux and gradients reduced once per
    dtype, nothing in a loop (test_cached.py's towers and loss)."""

    def loss_with_aux(params, outputs):
        value = models.clip_loss(params, outputs)
        return value, {"negative": value < 0, "labels": jnp.sum(outputs["label"])}

    mesh = jax.make_mesh((8,), ("data",))
    params, batch = models.towers()
    reference = jax.jit(
        jax.value_and_grad(
            lambda p, b: loss_with_aux(p, models.encode(p, b)), has_aux=True
        )
    )(params, batch)
    step = jaxaccum.cached_value_and_grad(
        models.encode, loss_with_aux, num_microbatches, mesh=mesh, has_aux=True
    )
    placed = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )
    compiled = jax.jit(step).lower(*placed).compile()
    chex.assert_trees_all_close(compiled(*placed), reference, rtol=RTOL, atol=ATOL)
    collectives = find_collectives(compiled)
    assert not [c for c in collectives if c.in_loop], collectives
    counts = {
        op: sum(c.op == op for c in collectives) for op in ("all-gather", "all-reduce")
    }
    assert counts == {"all-gather": 2, "all-reduce": 2}, collectives
    return f"collectives: {[(c.op, c.shapes) for c in collectives]}"


def run(name):
    if name == "outside_set_mesh_2d":
        return mesh_cases.check_outside_set_mesh("cached")
    if name == "inside_users_shard_map":
        return mesh_cases.check_inside_shard_map("cached")
    if name == "property_per_device":
        return check_property()
    if name == "mesh_keys_n2":
        return check_keys_per_device(2)
    if name == "mesh_labels_aux_n2":
        return check_labels_and_aux_per_device(2)
    if name.startswith("mesh_"):
        _, layout, num = name.split("_")
        return check_per_device(layout, int(num.removeprefix("n")))
    axis_type, num = name.split("_data_sharded_n")
    return check_sharded(axis_type, int(num))


def main():
    report(CHECKS, run, 8)


if __name__ == "__main__":
    sys.exit(main())
