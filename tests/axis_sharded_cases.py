"""The window as a named axis on 8 CPU devices, run by sharded_checks.py:
``jaxaccum.value_and_grad(..., axis_name="window")`` under plain ``jit`` on a
batch sharded over the devices. Each micro-batch spans every device (the
strided split keeps each device's rows on it), so a BatchNorm's statistics
and an all_gather over the window meet across the whole batch: the big
batch's value and gradients (chex, RTOL and ATOL of tests/tolerances.py:
float32, the same sums in another order), on Auto and Explicit meshes; and
per device through shard_value_and_grad, collectives over ("data",
"window") meeting across devices and micro-batches, nothing collective in a
loop; FSDP parameters gathered once; the window joining the data axis (Flax's
own BatchNorm(axis_name='batch')); and tests/axis_sharded_property.py's
property test over the options.
"""

import collections
import re

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum
from jaxaccum.testing import find_collectives

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


def device_loss(params, batch, both=("data", AXIS)):
    """The loss per device: BatchNorm and the gathered texts over the
    devices and the window together (``both``), the positive at the
    member's index."""
    hidden = (batch["x"] @ params["image"])[:, :4]
    mean = lax.pmean(jnp.mean(hidden, 0), both)
    var = lax.pmean(jnp.mean((hidden - mean) ** 2, 0), both)
    image = jnp.tanh((hidden - mean) * lax.rsqrt(var + 1e-5))
    texts = lax.all_gather(jnp.tanh(batch["y"] @ params["text"]), both, tiled=True)
    rows = image.shape[0]
    labels = lax.axis_index(both) * rows + jnp.arange(rows)
    log_probs = jax.nn.log_softmax(2.0 * image @ texts.T)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def check_shard(axis_type: str, num_microbatches: int) -> str:
    """shard_value_and_grad(axis_name=...): collectives over ("data",
    "window") meet across devices and micro-batches, the big batch's; in the
    compiled program one collective over the devices per collective over the
    window per pass (the statistics' all-reduce, the texts' all-gather, and
    the backward's), the gradients' all-reduce after the loops, and nothing
    collective in a loop."""
    params, batch = problem()
    want = jax.value_and_grad(big_batch)(params, batch)
    types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
    mesh = jax.make_mesh((8,), ("data",), axis_types=types)
    step = jax.jit(
        jaxaccum.shard_value_and_grad(
            device_loss, num_microbatches, mesh=mesh, axis_name=AXIS
        )
    )
    sharded = jaxaccum.shard_batch(batch, mesh)
    chex.assert_trees_all_close(step(params, sharded), want, rtol=RTOL, atol=ATOL)
    collectives = find_collectives(step.lower(params, sharded).compile())
    in_loops = [c for c in collectives if c.in_loop]
    assert not in_loops, in_loops
    # Forward: the two statistics' all-reduces and the texts' all-gather;
    # backward: their transposes (two all-reduces, a reduce-scatter); after
    # the loops, one all-reduce of the total and the gradients.
    counts = collections.Counter(c.op for c in collectives)
    wanted = {"all-reduce": 5, "all-gather": 1, "reduce-scatter": 1}
    assert counts == wanted, counts

    # Aux as the core reduces it over devices and micro-batches: a sum of
    # rows counts the whole batch; a per-micro-batch aux is refused.
    def with_aux(params, batch):
        rows = jnp.asarray(batch["x"].shape[0], jnp.float32)
        return device_loss(params, batch), {"rows": rows}

    counted = jaxaccum.shard_value_and_grad(
        with_aux,
        num_microbatches,
        mesh=mesh,
        axis_name=AXIS,
        has_aux=True,
        aux_reduction="sum",
    )
    (value, aux), _ = jax.jit(counted)(params, sharded)
    chex.assert_trees_all_close(value, want[0], rtol=RTOL, atol=ATOL)
    assert float(aux["rows"]) == BATCH, aux
    return (
        f"N={num_microbatches} ({axis_type}): the big batch's; "
        f"{len(collectives)} collectives, none in a loop: "
        + ", ".join(sorted(c.op for c in collectives))
    )


def check_fsdp(num_microbatches: int) -> str:
    """A weight sharded over the data axis (FSDP: 8 columns over 8 devices,
    4 of them used): gathered once before the window, its gradient
    reduce-scattered once after it, the big batch's value and gradients
    (sharded as the weight); in the compiled program nothing collective in
    a loop and exactly the parameter's gather and its gradient's scatter
    added to the replicated case's collectives."""
    params, batch = problem()
    mesh = jax.make_mesh((8,), ("data",))
    wide = jnp.concatenate([params["image"], jnp.ones((6, 4))], axis=1)
    fsdp = {
        **params,
        "image": jax.device_put(wide, NamedSharding(mesh, P(None, "data"))),
    }
    want = jax.value_and_grad(
        lambda p, b: big_batch({**p, "image": p["image"][:, :4]}, b)
    )({**params, "image": wide}, batch)
    step = jax.jit(
        jaxaccum.shard_value_and_grad(
            device_loss, num_microbatches, mesh=mesh, axis_name=AXIS
        )
    )
    sharded = jaxaccum.shard_batch(batch, mesh)
    value, grads = step(fsdp, sharded)
    chex.assert_trees_all_close((value, grads), want, rtol=RTOL, atol=ATOL)
    assert grads["image"].sharding.spec == P(None, "data"), grads["image"].sharding
    compiled = step.lower(fsdp, sharded).compile()
    collectives = find_collectives(compiled)
    assert not [c for c in collectives if c.in_loop], collectives
    counts = collections.Counter(c.op for c in collectives)
    # The replicated case's all-gather and reduce-scatter (the texts') plus
    # the weight's all-gather before the window and its gradient's
    # reduce-scatter after it, whole weight and shard; its all-reduces (at
    # most five: XLA's combiner may merge the gradients' into a backward one).
    assert (counts["all-gather"], counts["reduce-scatter"]) == (2, 2), collectives
    assert counts["all-reduce"] <= 5, collectives
    assert {"f32[6,8]", "f32[6,1]"} <= {c.shapes[0] for c in collectives}, collectives
    # plan_modes compiles the one combination this window takes, the step.
    planned = jaxaccum.plan_modes(
        device_loss,
        fsdp,
        sharded,
        num_microbatches=num_microbatches,
        memory_budget="1GiB",
        mesh=mesh,
        axis_name=AXIS,
    )
    (row,) = planned.rows
    assert (row.param_gather, row.grad_reduce) == ("window", "window"), planned
    assert row.temp_bytes == compiled.memory_analysis().temp_size_in_bytes, planned
    per_micro = jaxaccum.shard_value_and_grad(
        device_loss, 2, mesh=mesh, axis_name=AXIS, param_gather="microbatch"
    )
    try:
        per_micro(fsdp, sharded)
    except ValueError as error:
        assert "param_gather='microbatch' with axis_name" in str(error), error
    else:
        raise AssertionError("param_gather='microbatch' with FSDP not refused")

    # Without a collective over the axis the plain window runs, every mode
    # honoured.
    def plain_loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ params["image"][:, :4]) ** 2)

    per_micro = jaxaccum.shard_value_and_grad(
        plain_loss, 2, mesh=mesh, axis_name=AXIS, param_gather="microbatch"
    )
    want = jax.value_and_grad(plain_loss)({**params, "image": wide}, batch)
    chex.assert_trees_all_close(
        jax.jit(per_micro)(fsdp, sharded), want, rtol=RTOL, atol=ATOL
    )
    return (
        f"FSDP, N={num_microbatches}: the big batch's; gathered and "
        f"scattered once, none in a loop: {dict(counts)}"
    )


def check_joined_flax() -> str:
    """Flax's own BatchNorm written for devices named "batch" (as Flax's
    ImageNet ResNet writes it), unedited, under shard_value_and_grad with
    axis_name equal to the data axis: the value, the gradients and the new
    running averages (aux, the same on every member) are the big batch's,
    where the same module normalises over all rows with no axis."""
    import flax.linen as nn

    class Model(nn.Module):
        axis_name: str | None

        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4)(x)
            x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)
            return nn.Dense(1)(jnp.tanh(x))[:, 0]

    def loss_of(model):
        def loss(params, stats, batch):
            out, new = model.apply(
                {"params": params, "batch_stats": stats},
                batch["x"],
                mutable=["batch_stats"],
            )
            return jnp.mean((out - batch["y"][:, 0]) ** 2), new["batch_stats"]

        return loss

    _, batch = problem()
    variables = Model(None).init(jax.random.key(1), batch["x"])
    params, stats = variables["params"], variables["batch_stats"]
    mesh = jax.make_mesh((8,), ("batch",))
    step = jax.jit(
        jaxaccum.shard_value_and_grad(
            loss_of(Model("batch")),
            2,
            mesh=mesh,
            data_axis="batch",
            axis_name="batch",
            batch_argnums=2,
            has_aux=True,
        )
    )
    got = step(params, stats, jaxaccum.shard_batch(batch, mesh, data_axis="batch"))
    want = jax.value_and_grad(loss_of(Model(None)), has_aux=True)(params, stats, batch)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
    return (
        "Flax BatchNorm(axis_name='batch'), joined: value, grads, stats the big batch's"
    )


def check_no_collective() -> str:
    """A loss with no collective over the window: the plain window per
    device (run in the shard_map without varying-axis types), the big
    batch's."""
    params, batch = problem()

    def plain_loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ params["image"]) ** 2)

    mesh = jax.make_mesh((8,), ("data",))
    step = jax.jit(
        jaxaccum.shard_value_and_grad(plain_loss, 2, mesh=mesh, axis_name=AXIS)
    )
    got = step(params, jaxaccum.shard_batch(batch, mesh))
    want = jax.value_and_grad(plain_loss)(params, batch)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)
    return "the plain window per device: the big batch's"


def check_refusals() -> str:
    """axis_name equal to a mesh axis other than the data axis, a
    per-micro-batch aux, and a call inside the caller's own shard_map: each
    a jaxaccum error naming it."""
    params, batch = problem()
    mesh = jax.make_mesh((8,), ("data",))
    sharded = jaxaccum.shard_batch(batch, mesh)
    grid = jax.make_mesh((4, 2), ("data", "model"))
    clash = jaxaccum.shard_value_and_grad(device_loss, 2, mesh=grid, axis_name="model")
    on_grid = jaxaccum.shard_batch(batch, grid)
    inside = jax.shard_map(
        lambda p, b: jaxaccum.shard_value_and_grad(
            device_loss, 2, data_axis="data", axis_name=AXIS
        )(p, b),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P(),
    )
    last = jaxaccum.shard_value_and_grad(
        lambda p, b: (device_loss(p, b), {"loss": device_loss(p, b)}),
        2,
        mesh=mesh,
        axis_name=AXIS,
        has_aux=True,
        aux_reduction="last",
    )
    cases = {
        "is an axis of the mesh.* but not a data axis": lambda: clash(params, on_grid),
        r"aux_reduction \['last'\] is not supported": lambda: last(params, sharded),
        "inside the caller's own shard_map": lambda: inside(params, sharded),
    }
    for wanted, call in cases.items():
        try:
            call()
        except ValueError as error:
            assert re.search(wanted, str(error)), (wanted, str(error))
        else:
            raise AssertionError(f"no error: {wanted}")
    return "refused: " + "; ".join(cases)


def nt_xent(params, batch, axes=AXIS):
    """SimCLR's NT-Xent written for data parallelism, as a public Flax SimCLR
    writes it: each member's slice holds both views of its examples (the
    first half and the second), every row scored against every member's
    rows, the positive found in the same slice (``axis_index`` offset)."""
    z = jnp.tanh(batch @ params["image"])
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    rows = z.shape[0]
    everyone = lax.all_gather(z, axes, tiled=True)
    mine = lax.axis_index(axes) * rows + jnp.arange(rows)
    logits = z @ everyone.T / 0.5 - 1e9 * jax.nn.one_hot(mine, everyone.shape[0])
    positive = mine - jnp.arange(rows) + (jnp.arange(rows) + rows // 2) % rows
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, positive[:, None], axis=1))


def data_parallel(loss, params, batch, members):
    """``loss`` as data parallelism runs it on ``members`` devices, each
    holding the next contiguous block of the batch."""
    blocks = batch.reshape(members, batch.shape[0] // members, *batch.shape[1:])

    def mean(params):
        return jnp.mean(jax.vmap(lambda b: loss(params, b), axis_name=AXIS)(blocks))

    return jax.value_and_grad(mean)(params)


def check_contiguous_layout() -> str:
    """axis_layout='contiguous' per device: member d N + k holds block
    d N + k, so NT-Xent written for D x N data-parallel devices runs
    unedited, named ("data", "window") or joined to "data"; under plain jit
    a batch sharded over the devices is refused (its blocks would move)."""
    params, batch = problem()
    mesh = jax.make_mesh((8,), ("data",))
    want = data_parallel(nt_xent, params, batch["x"], 16)
    sharded = jaxaccum.shard_batch(batch["x"], mesh)
    for axis_name, axes in ((AXIS, ("data", AXIS)), ("data", "data")):
        step = jaxaccum.shard_value_and_grad(
            lambda p, b, axes=axes: nt_xent(p, b, axes),
            2,
            mesh=mesh,
            axis_name=axis_name,
            axis_layout="contiguous",
        )
        chex.assert_trees_all_close(
            jax.jit(step)(params, sharded), want, rtol=RTOL, atol=ATOL
        )
    plain = jaxaccum.value_and_grad(
        nt_xent, 2, axis_name=AXIS, axis_layout="contiguous"
    )
    try:
        with jax.set_mesh(mesh):
            jax.jit(plain)(params, sharded)
    except ValueError as error:
        assert "sharded over 8 devices" in str(error), str(error)
    else:
        raise AssertionError("a sharded batch split contiguously under jit")
    return "contiguous: D x N data-parallel members, named, joined; refused under jit"


CHECKS = {
    "axis_name_auto_n4": lambda: check_under_jit("auto", 4),
    "axis_name_explicit_n2": lambda: check_under_jit("explicit", 2),
    "axis_name_shard_auto_n2": lambda: check_shard("auto", 2),
    "axis_name_shard_fsdp_n2": lambda: check_fsdp(2),
    "axis_name_shard_joined_flax": check_joined_flax,
    "axis_name_shard_property": lambda: _property(),
    "axis_name_shard_refusals": check_refusals,
    "axis_name_shard_no_collective": check_no_collective,
    "axis_name_contiguous_layout": check_contiguous_layout,
}


def _property() -> str:
    """tests/axis_sharded_property.py's property test (imported here, as it
    imports this module's loss and problem)."""
    from axis_sharded_property import check_property

    return check_property()
