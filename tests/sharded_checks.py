"""Sharded parameters on 8 CPU devices (data=4 x model=2), run by
test_sharded.py in its own process (``--xla_force_host_platform_device_count=8``).

A 4-layer Megatron-style MLP (column-parallel then row-parallel layers) with
parameters replicated, FSDP-sharded over "data", tensor-parallel over "model",
or both, on Auto and Explicit meshes. Every accumulated step is compared with
the single-device full-batch gradient (chex, RTOL and ATOL of
tests/tolerances.py) and its compiled HLO is read for what it communicates.
Also: frozen (not differentiated) array arguments, positional and keyword,
and bfloat16 FSDP parameters, whose gradients must be reduced in float32;
and ``mesh=`` / ``data_axis=`` used outside ``jax.set_mesh`` on a 2-D mesh
and inside the caller's own ``shard_map`` (``mesh_*``, tests/mesh_cases.py);
the window as a named axis under plain ``jit`` (``axis_name_*``,
tests/axis_sharded_cases.py).
Prints one JSON object, ``{check name: {"ok": bool, "detail": str}}``, as the
last line of stdout.
"""

import sys

import axis_sharded_cases
import chex
import jax
import jax.numpy as jnp
import mesh_cases
from check_scripts import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum
from jaxaccum.testing import find_collectives

NUM_MICROBATCHES = 4
BATCH_SIZE = 64  # 16 rows per data shard, 4 per micro-batch
SIZES = (8, 32, 24, 12, 4)  # distinct shapes: a gathered weight is recognisable
DATA_SIZE = 4
MODES = (
    ("window", "window"),
    ("window", "microbatch"),
    ("microbatch", "window"),
    ("microbatch", "microbatch"),
    ("auto", "auto"),
)
LAYOUTS = ("replicated", "fsdp", "tp", "fsdp_tp")
AXIS_TYPES = ("auto", "explicit")
# A frozen teacher's sharding: on the data x model mesh, or on a 1-D (data,)
# mesh of all 8 devices ("mesh1d_").
FROZEN_CASES = ("replicated", "model", "data", "mesh1d_replicated", "mesh1d_data")
FROZEN_SPECS = {"replicated": P(), "model": P(None, "model"), "data": P("data", None)}
BF16_LAYOUTS = ("fsdp", "fsdp_tp")

CHECKS = [
    f"{layout}_{axis_type}_{name}"
    for axis_type in AXIS_TYPES
    for layout in LAYOUTS
    for name in ("value_and_grad", *(f"{g}_{r}" for g, r in MODES))
] + [
    "plan_modes_fsdp",
    "report_stats_fsdp_tp",
    "window_bytes_fsdp",
    "gather_dtype_bfloat16",
    "misaligned_fsdp_is_an_error",
    *(
        f"frozen_{axis_type}_{case}"
        for axis_type in AXIS_TYPES
        for case in FROZEN_CASES
    ),
    *(f"bfloat16_{layout}" for layout in BF16_LAYOUTS),
    "plan_modes_bfloat16_fsdp",
    "mesh_outside_set_mesh_2d",
    "mesh_inside_users_shard_map",
    *axis_sharded_cases.CHECKS,
]


def params_of(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": 0.1 * jnp.ones(b)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def layer_specs(layout):
    """Even layers column-parallel (output features over "model"), odd layers
    row-parallel (input features over "model"); FSDP takes the other dim."""
    specs = []
    for index in range(len(SIZES) - 1):
        column = index % 2 == 0
        tp = layout in ("tp", "fsdp_tp")
        fsdp = layout in ("fsdp", "fsdp_tp")
        model = "model" if tp else None
        data = "data" if fsdp else None
        w = P(data, model) if column else P(model, data)
        if layout == "fsdp":
            w = P("data", None)
        specs.append({"w": w, "b": P(model) if column else P()})
    return specs


def loss(params, batch):
    """Mean squared error; row-parallel products name their output sharding
    where the mesh is Explicit (there a sharded contraction needs one)."""
    x = batch["x"]
    for index, layer in enumerate(params):
        sharding = jax.typeof(x).sharding
        explicit = AxisType.Explicit in getattr(sharding.mesh, "axis_types", ())
        if index % 2 and explicit:
            x = jnp.matmul(x, layer["w"], out_sharding=P(sharding.spec[0], None))
        else:
            x = x @ layer["w"]
        x = x + layer["b"]
        if index < len(params) - 1:
            x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2)


def batch_of(key):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (BATCH_SIZE, SIZES[0])),
        "y": jax.random.normal(ky, (BATCH_SIZE, SIZES[-1])),
    }


def setup(layout, axis_type):
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
    mesh = jax.make_mesh((DATA_SIZE, 2), ("data", "model"), axis_types=(kind, kind))
    params, batch = params_of(jax.random.key(0)), batch_of(jax.random.key(1))
    specs = layer_specs(layout)
    sharded_params = jax.device_put(
        params, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    )
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return mesh, specs, (params, batch), (sharded_params, sharded_batch)


def compiled_step(fun, mesh, specs, args, axis_type):
    """jit(fun) on ``args``; on an Auto mesh the shardings are declared with
    jax.sharding.explicit_axes, as docs/guides/distributed.md says to."""
    with jax.set_mesh(mesh):
        if axis_type == "auto":
            fun = jax.sharding.explicit_axes(fun, in_sharding=(specs, P("data")))
        step = jax.jit(fun)
        compiled = step.lower(*args).compile()
        return compiled, step(*args)


def check_common(out, reference, sharded_params, compiled):
    chex.assert_trees_all_close(out, reference, rtol=RTOL, atol=ATOL)
    for (path, grad), param in zip(
        jax.tree_util.tree_leaves_with_path(out[1]),
        jax.tree.leaves(sharded_params),
        strict=True,
    ):
        assert grad.sharding.is_equivalent_to(param.sharding, param.ndim), (
            f"grads{jax.tree_util.keystr(path)}: {grad.sharding.spec}, "
            f"parameter {param.sharding.spec}"
        )
    collectives = find_collectives(compiled)
    moved = [c for c in collectives if c.op in ("all-to-all", "collective-permute")]
    assert not moved, f"data re-laid out: {moved}"
    assert " while(" in compiled.as_text(), "the micro-batch loop was unrolled"
    return collectives


def check_no_whole_tp_weight(collectives, params, specs):
    """No all-gather returns a whole tensor-parallel weight."""
    whole = {
        f"f32[{','.join(map(str, p.shape))}]"
        for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True)
        if "model" in tuple(s)
    }
    gathered = [
        c for c in collectives if c.op == "all-gather" and set(c.shapes) & whole
    ]
    assert not gathered, f"a tensor-parallel weight gathered whole: {gathered}"


def check_matrix(layout, axis_type, name):
    mesh, specs, (params, batch), args = setup(layout, axis_type)
    reference = jax.jit(jax.value_and_grad(loss))(params, batch)
    if name == "value_and_grad":
        fun = jaxaccum.value_and_grad(loss, NUM_MICROBATCHES)
        gather, reduce = None, None
    else:
        gather, reduce = name.split("_")
        fun = jaxaccum.shard_value_and_grad(
            loss, NUM_MICROBATCHES, param_gather=gather, grad_reduce=reduce
        )
    compiled, out = compiled_step(fun, mesh, specs, args, axis_type)
    collectives = check_common(out, reference, args[0], compiled)
    check_no_whole_tp_weight(collectives, params, specs)
    in_loop = [c for c in collectives if c.in_loop]
    if reduce == "window":
        data_reductions = [
            c
            for c in in_loop
            if c.op in ("all-reduce", "reduce-scatter") and c.group_size == DATA_SIZE
        ]
        assert not data_reductions, f"reduced over data in the loop: {data_reductions}"
    if gather == "window":
        gathers = [c for c in in_loop if c.op == "all-gather"]
        assert not gathers, f"gathered in the loop: {gathers}"
    if gather == "microbatch" and layout in ("fsdp", "fsdp_tp"):
        assert any(c.op == "all-gather" for c in in_loop), "gather hoisted out"
    counts = {
        op: [
            sum(c.op == op and c.in_loop == place for c in collectives)
            for place in (True, False)
        ]
        for op in ("all-reduce", "all-gather", "reduce-scatter")
    }
    return f"(loop, outside) {counts}"


def check_window_bytes():
    """Gather-once + reduce-once moves ~1/N of the per-micro-batch bytes."""
    mesh, specs, _, args = setup("fsdp", "explicit")
    ratios = []
    for num in (2, 4, 8):
        moved = {}
        for mode in ("window", "microbatch"):
            fun = jaxaccum.shard_value_and_grad(
                loss, num, param_gather=mode, grad_reduce=mode
            )
            compiled, _ = compiled_step(fun, mesh, specs, args, "explicit")
            moved[mode] = jaxaccum.testing.window_bytes(compiled, num)
        # + 1 KiB: the loss (and other scalars) reduced once either way.
        assert moved["window"] <= moved["microbatch"] / num + 1024, (num, moved)
        ratios.append(f"N={num}: {moved['window']}/{moved['microbatch']} B")
    return "; ".join(ratios)


def check_gather_dtype():
    """bfloat16 gathers: half the gather bytes in the program JAX emits,
    float32 gradients near the full-batch ones (the loss sees bfloat16-rounded
    weights: rtol 2e-2). XLA:CPU runs bfloat16 collectives in float32 (its
    compiled HLO gathers float32), so the bytes are read before XLA's passes."""
    mesh, specs, (params, batch), args = setup("fsdp", "explicit")
    reference = jax.jit(jax.value_and_grad(loss))(params, batch)
    gathered = {}
    for dtype in (None, jnp.bfloat16):
        fun = jaxaccum.shard_value_and_grad(
            loss, NUM_MICROBATCHES, param_gather="window", gather_dtype=dtype
        )
        _, out = compiled_step(fun, mesh, specs, args, "explicit")
        with jax.set_mesh(mesh):
            emitted = jax.jit(fun).lower(*args).as_text(dialect="hlo")
        gathered[dtype] = jaxaccum.testing.collective_bytes(emitted)["all-gather"][
            "outside"
        ]
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(out[1]))
    chex.assert_trees_all_close(out, reference, rtol=2e-2, atol=2e-3)
    assert gathered[None] > 0 and gathered[jnp.bfloat16] * 2 == gathered[None], gathered
    return (
        f"all-gather bytes float32 {gathered[None]}, bfloat16 {gathered[jnp.bfloat16]}"
    )


def check_misaligned():
    """A weight sharded over ("model", "data") on one dimension: named."""
    mesh, _, _, (params, sharded_batch) = setup("replicated", "explicit")
    params[0]["w"] = jax.sharding.reshard(
        params[0]["w"], NamedSharding(mesh, P(("model", "data"), None))
    )
    with jax.set_mesh(mesh):
        try:
            jaxaccum.shard_value_and_grad(loss, 2)(params, sharded_batch)
        except ValueError as error:
            assert "args[argnums][0]['w']" in str(error), error
            return str(error)[:120]
    raise AssertionError("no error for a parameter sharded over model and data")


def check_plan_modes():
    """Per-device figures: FSDP parameters count 1/4; gather-once +
    reduce-once moves the fewest bytes, per micro-batch holds the least."""
    mesh, specs, (params, batch), args = setup("fsdp", "explicit")
    with jax.set_mesh(mesh):
        result = jaxaccum.plan_modes(
            loss, *args, num_microbatches=8, memory_budget="1GiB"
        )
        replicated = jaxaccum.plan(
            loss, params, args[1], memory_budget="1GiB", candidates=[8]
        )
        sharded = jaxaccum.plan(loss, *args, memory_budget="1GiB", candidates=[8])
    rows = {(row.param_gather, row.grad_reduce): row for row in result.rows}
    assert (result.param_gather, result.grad_reduce) == ("window", "window"), result
    per_micro = rows["microbatch", "microbatch"]
    assert rows["window", "window"].window_bytes * 8 <= per_micro.window_bytes + 8192
    assert per_micro.temp_bytes < rows["window", "window"].temp_bytes, result
    weights = sum(p.nbytes for p in jax.tree.leaves(params) if p.ndim == 2)
    saved = replicated.rows[0].argument_bytes - sharded.rows[0].argument_bytes
    assert saved == weights * 3 // 4, (saved, weights)
    return str(result).replace("\n", " | ")


def check_report_stats():
    """WindowStats under FSDP + TP equal those with replicated parameters (the
    same rows per device): the window's squared norm sums the shards over the
    data axis once, and equals the full-batch gradient's."""
    mesh, specs, (params, batch), args = setup("fsdp_tp", "explicit")
    _, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
    expected = sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))
    rep_mesh, rep_specs, _, rep_args = setup("replicated", "explicit")
    fun = jaxaccum.shard_value_and_grad(loss, NUM_MICROBATCHES, report_stats=True)
    _, (_, replicated) = compiled_step(fun, rep_mesh, rep_specs, rep_args, "explicit")
    for gather, reduce in (("window", "window"), ("microbatch", "microbatch")):
        fun = jaxaccum.shard_value_and_grad(
            loss,
            NUM_MICROBATCHES,
            param_gather=gather,
            grad_reduce=reduce,
            report_stats=True,
        )
        _, (_, stats) = compiled_step(fun, mesh, specs, args, "explicit")
        chex.assert_trees_all_close(stats.grad_sq_norm, expected, rtol=RTOL)
        chex.assert_trees_all_close(stats, replicated, rtol=RTOL, atol=ATOL)
    return f"|G_B|^2 {float(stats.grad_sq_norm):.6f}, noise scale {stats.noise_scale}"


def distill_loss(params, batch, teacher, *, head, temperature):
    """``loss`` against targets moved by two frozen weights, a teacher
    (positional, not differentiated) and a head (keyword), and a Python
    number (closed over)."""
    x = batch["x"]
    shift = (x @ teacher + x @ head) / temperature
    return loss(params, {"x": x, "y": batch["y"] + shift})


def frozen_setup(axis_type, case):
    """The mesh, the parameters' specs and the arguments of a frozen check:
    FSDP + TP parameters on the Explicit 2-D mesh, replicated elsewhere (an
    Auto mesh is called with a plain jit, shardings unseen)."""
    kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
    one_d = case.startswith("mesh1d_")
    shape, names = ((8,), ("data",)) if one_d else ((DATA_SIZE, 2), ("data", "model"))
    mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))
    layout = "fsdp_tp" if axis_type == "explicit" and not one_d else "replicated"
    specs = layer_specs(layout)
    teacher, head = (
        jax.random.normal(key, (SIZES[0], SIZES[-1]))
        for key in jax.random.split(jax.random.key(2))
    )
    unsharded = (params_of(jax.random.key(0)), batch_of(jax.random.key(1)))
    frozen_spec = FROZEN_SPECS[case.removeprefix("mesh1d_")]
    sharded = jax.device_put(
        (*unsharded, teacher, head),
        jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            (specs, P("data"), frozen_spec, frozen_spec),
        ),
    )
    return mesh, specs, (*unsharded, teacher, head), sharded


def check_frozen(axis_type, case):
    """Arrays that are not differentiated (a teacher, positional; a head,
    keyword) enter the shard_map as arguments: the step equals the
    full-batch one, and a frozen weight sharded over "model" stays so."""
    mesh, specs, (params, batch, teacher, head), args = frozen_setup(axis_type, case)
    reference = jax.jit(jax.value_and_grad(distill_loss))(
        params, batch, teacher, head=head, temperature=2.0
    )
    fun = jaxaccum.shard_value_and_grad(distill_loss, NUM_MICROBATCHES)
    with jax.set_mesh(mesh):
        step = jax.jit(lambda p, b, t, h: fun(p, b, t, head=h, temperature=2.0))
        compiled = step.lower(*args).compile()
        out = step(*args)
    chex.assert_trees_all_close(out, reference, rtol=RTOL, atol=ATOL)
    # On an Auto mesh under a plain jit, GSPMD picks the outputs' shardings.
    for (path, grad), param in zip(
        jax.tree_util.tree_leaves_with_path(out[1]),
        jax.tree.leaves(args[0]),
        strict=True,
    ):
        assert axis_type == "auto" or grad.sharding.is_equivalent_to(
            param.sharding, param.ndim
        ), (
            f"grads{jax.tree_util.keystr(path)}: {grad.sharding.spec}, "
            f"parameter {param.sharding.spec}"
        )
    collectives = find_collectives(compiled)
    if case == "model":
        whole = f"f32[{SIZES[0]},{SIZES[-1]}]"
        gathered = [
            c for c in collectives if c.op == "all-gather" and whole in c.shapes
        ]
        assert not gathered, f"a frozen weight sharded over model gathered: {gathered}"
    ops = sorted({c.op for c in collectives})
    return f"teacher {args[2].sharding.spec}, collectives {ops}"


def bfloat16_setup(layout):
    """``setup`` on the Explicit data x model mesh with bfloat16 parameters
    (the batch stays float32, so the loss computes in float32)."""
    mesh, specs, (params, batch), (sharded_params, sharded_batch) = setup(
        layout, "explicit"
    )
    params, sharded_params = jax.tree.map(
        lambda p: p.astype(jnp.bfloat16), (params, sharded_params)
    )
    return mesh, specs, (params, batch), (sharded_params, sharded_batch)


def low_precision_reductions(collectives):
    """The all-reduces and reduce-scatters over the data axis (groups of
    DATA_SIZE devices; those over "model" have 2) not in float32."""
    return [
        c
        for c in collectives
        if c.op in ("all-reduce", "reduce-scatter")
        and c.group_size == DATA_SIZE
        and set(c.dtypes) != {"f32"}
    ]


def piece_grads(params, batch):
    """The float32 gradient of each (device, micro-batch) piece of the
    window, stacked: device d's micro-batch k holds its local rows k, k + N,
    ..., i.e. global rows d * L + k + N * j (L rows per device)."""
    local = BATCH_SIZE // DATA_SIZE
    rows = (
        local * jnp.arange(DATA_SIZE)[:, None, None]
        + jnp.arange(NUM_MICROBATCHES)[None, :, None]
        + NUM_MICROBATCHES * jnp.arange(local // NUM_MICROBATCHES)[None, None, :]
    ).reshape(DATA_SIZE * NUM_MICROBATCHES, -1)
    pieces = jax.tree.map(lambda leaf: leaf[rows], batch)
    return jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, pieces)


def check_bfloat16_grads(out, params, batch):
    """bfloat16 gradients within a bound derived per element; returns the
    largest error / bound.

    bfloat16 keeps 8 significant bits: rounding to it costs at most 2^-8 of
    the value. The reference differentiates the bfloat16 parameters upcast to
    float32 (the loss sees exactly those values: the batch is float32), so
    two roundings remain: JAX's AD returns each piece's gradient g_p in the
    parameter's dtype (2^-8 |g_p| each, 2^-8 mean_p |g_p| in the mean), and
    the final cast of the float32 window mean (2^-8 of it, i.e. of |G| plus
    the first error: the factor 1 + 2^-8). The float32 sums add RTOL, ATOL as
    elsewhere. A bfloat16 reduction would round every partial sum too; that
    the HLO check catches, whatever the numbers.
    """
    upcast = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    value, grads = jax.jit(jax.value_and_grad(loss))(upcast, batch)
    chex.assert_trees_all_close(out[0], value, rtol=RTOL, atol=ATOL)  # float32
    mean_abs = jax.tree.map(
        lambda g: jnp.mean(jnp.abs(g), axis=0), piece_grads(upcast, batch)
    )
    bounds = jax.tree.map(
        lambda g, m: (2**-8 * (1 + 2**-8) + RTOL) * (jnp.abs(g) + m) + ATOL,
        grads,
        mean_abs,
    )
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(out[1]))
    errors = jax.tree.map(
        lambda o, g: jnp.abs(o.astype(jnp.float32) - g), out[1], grads
    )
    chex.assert_trees_all_equal_comparator(
        lambda error, bound: bool(jnp.all(error <= bound)),
        lambda error, bound: f"error {float(jnp.max(error / bound)):.3f} x bound",
        errors,
        bounds,
    )
    ratios = jax.tree.map(lambda error, bound: jnp.max(error / bound), errors, bounds)
    return max(float(ratio) for ratio in jax.tree.leaves(ratios))


def check_bfloat16(layout):
    """bfloat16 FSDP parameters with the default modes: the step compiles
    (XLA:CPU aborts on a bfloat16 reduce-scatter), every gradient reduction
    over the data axis runs in float32 in every mode (in the HLO JAX emits,
    what GPUs and TPUs run; XLA:CPU promotes bfloat16 collectives itself, so
    its compiled HLO shows float32 either way), and the gradients are within
    the bfloat16 bound of the float32 ones."""
    mesh, specs, (params, batch), args = bfloat16_setup(layout)
    fun = jaxaccum.shard_value_and_grad(loss, NUM_MICROBATCHES)
    compiled, out = compiled_step(fun, mesh, specs, args, "explicit")
    low = low_precision_reductions(find_collectives(compiled))
    assert not low, f"compiled: reductions over data not in float32: {low}"
    scattered = {}
    for gather, reduce in MODES:
        step = jaxaccum.shard_value_and_grad(
            loss, NUM_MICROBATCHES, param_gather=gather, grad_reduce=reduce
        )
        with jax.set_mesh(mesh):
            emitted = jax.jit(step).lower(*args).as_text(dialect="hlo")
        low = low_precision_reductions(find_collectives(emitted))
        assert not low, f"{gather}/{reduce}: reductions not in float32: {low}"
        scattered[f"{gather}/{reduce}"] = jaxaccum.testing.collective_bytes(emitted)[
            "reduce-scatter"
        ]
    worst = check_bfloat16_grads(out, params, batch)
    return f"error <= {worst:.3f} x bound; f32 reduce-scatter bytes {scattered}"


def check_plan_modes_bfloat16():
    """plan_modes compiles every mode of the bfloat16 FSDP step."""
    mesh, _, _, args = bfloat16_setup("fsdp")
    with jax.set_mesh(mesh):
        result = jaxaccum.plan_modes(
            loss, *args, num_microbatches=NUM_MICROBATCHES, memory_budget="1GiB"
        )
    assert len(result.rows) == 4, result
    return str(result).replace("\n", " | ")


def run(name):
    if name in axis_sharded_cases.CHECKS:
        return axis_sharded_cases.CHECKS[name]()
    if name == "mesh_outside_set_mesh_2d":
        return mesh_cases.check_outside_set_mesh("shard")
    if name == "mesh_inside_users_shard_map":
        return mesh_cases.check_inside_shard_map("shard")
    if name.startswith("frozen_"):
        axis_type, case = name.removeprefix("frozen_").split("_", 1)
        return check_frozen(axis_type, case)
    if name.startswith("bfloat16_"):
        return check_bfloat16(name.removeprefix("bfloat16_"))
    if name == "plan_modes_bfloat16_fsdp":
        return check_plan_modes_bfloat16()
    if name == "report_stats_fsdp_tp":
        return check_report_stats()
    if name == "plan_modes_fsdp":
        return check_plan_modes()
    if name == "window_bytes_fsdp":
        return check_window_bytes()
    if name == "gather_dtype_bfloat16":
        return check_gather_dtype()
    if name == "misaligned_fsdp_is_an_error":
        return check_misaligned()
    layout, rest = (
        name.split("_", 1)
        if not name.startswith("fsdp_tp")
        else ("fsdp_tp", name[len("fsdp_tp_") :])
    )
    axis_type, mode = rest.split("_", 1)
    return check_matrix(layout, axis_type, mode)


def main():
    report(CHECKS, run, 8)


if __name__ == "__main__":
    sys.exit(main())
