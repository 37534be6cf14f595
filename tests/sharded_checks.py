"""Sharded parameters on 8 CPU devices (data=4 x model=2), run by
test_sharded.py in its own process (``--xla_force_host_platform_device_count=8``).

A 4-layer Megatron-style MLP (column-parallel then row-parallel layers) with
parameters replicated, FSDP-sharded over "data", tensor-parallel over "model",
or both, on Auto and Explicit meshes. Every accumulated step is compared with
the single-device full-batch gradient (chex, rtol=1e-5, atol=1e-6) and its
compiled HLO is read for what it communicates. Prints one JSON object,
``{check name: {"ok": bool, "detail": str}}``, as the last line of stdout.
"""

import sys

import chex
import jax
import jax.numpy as jnp
from check_scripts import report
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum.testing import find_collectives

RTOL, ATOL = 1e-5, 1e-6
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
            moved[mode] = jaxaccum.window_bytes(compiled, num)
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
        gathered[dtype] = jaxaccum.collective_bytes(emitted)["all-gather"]["outside"]
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


def run(name):
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
