"""Pipeline parallelism on 8 CPU devices, run by test_pipeline.py in its own
process (``--xla_force_host_platform_device_count=8``).

Every pipelined step is compared with ``jax.value_and_grad`` of the same model
run sequentially on the whole batch on one device (chex), and its compiled
program is read: which collectives run in the loop and outside it, and how
many bytes; FLOPs (``cost_analysis``) against the bubble formula; memory
(``memory_analysis``) per device. Prints one JSON object, ``{check name:
{"ok": bool, "detail": str}}``, as the last line of stdout.

Tolerances. The pipeline and the sequential model compute the same products
on the same rows; what differs is the order of the float sums: each
contraction (over FEATURES terms, or INPUTS), each micro-batch's own batch
sum, then the sum over micro-batches (at most BATCH rows in all). Summing
``n`` terms in any order errs by at most ``(n - 1) u sum|t_i|`` (Higham 4.2),
so two orders differ by at most twice that. A gradient coordinate is a sum
over the rows of terms that went through at most ``2 LAYERS + 2``
contractions (forward to the loss, back to the layer); the stages are
``tanh(x Q + b)`` with ``Q`` orthogonal, so each is 1-Lipschitz and an error
made in one contraction is not amplified by the next: the relative errors
add. On this unit-scale data ``sum|t_i|`` is at most about 1, so ATOL = RTOL.
Float64 is the same bound with its own ``u``. A real mistake (a micro-batch
counted twice or in a bubble, a stage applied out of order, a gradient
scaled by the wrong count) moves results by 1e-2 and more.
"""

import contextlib
import dataclasses
import functools
import itertools
import resource
import sys
import time
import unittest.mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from check_scripts import report
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import UNIT_ROUNDOFF

import jaxaccum
from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum._pipeline._spec import PipelineLayout, PipelineWindow
from jaxaccum._pipeline._step import make_pipeline
from jaxaccum._pipeline._zero_bubble import ZeroBubble
from jaxaccum._plan._hlo import collective_bytes, find_collectives, window_bytes
from jaxaccum._types import STAGE_ORDERS

INPUTS, FEATURES, OUTPUTS = 4, 16, 2
ROWS = 4  # rows of one micro-batch on one data shard
LAYERS = 8  # the most model stages a check runs (S R)
BATCH = 64  # the most rows a check's batch has


def tolerance(
    unit_roundoff: float, layers=LAYERS, features=FEATURES, batch=BATCH
) -> float:
    """Twice the float sums' error bound, added over a gradient's chain."""
    return 2 * unit_roundoff * ((2 * layers + 2) * features + batch)


RTOL = tolerance(UNIT_ROUNDOFF)  # 4.5e-5
ATOL = RTOL
RTOL64 = tolerance(2.0**-53)  # 8.4e-14

# (name, mesh shape, mesh axes, data axis, M, R): stage=8; stage=4 x data=2;
# stage=2 x fsdp=4 with FSDP stage parameters (the data axis is "fsdp").
# M = S, M < S (stage8_M3, in sum_reduction), M = 7 with S = 4, R = 2 with
# M > S (and M = S, on an Auto mesh), R = 3 with M > S.
EXACT = (
    ("stage8_M8", (8,), ("stage",), None, 8, 1),
    ("stage8_M3", (8,), ("stage",), None, 3, 1),
    ("stage4_data2_M7", (4, 2), ("stage", "data"), "data", 7, 1),
    ("stage4_data2_M8_R2", (4, 2), ("stage", "data"), "data", 8, 2),
    ("stage4_data2_M4_R2", (4, 2), ("stage", "data"), "data", 4, 2),
    ("stage2_fsdp4_M5_R3", (2, 4), ("stage", "fsdp"), "fsdp", 5, 3),
)
# schedule="1f1b" (R = 1): M = S, 2S, 4S on stage=8; S, 7, 2S, 4S on
# stage=4 x data=2; S, 2S, 4S on stage=2 x fsdp=4 (FSDP stage parameters).
ONE_F_ONE_B = (
    ("stage8_M8", (8,), ("stage",), None, 8, 1),
    ("stage8_M16", (8,), ("stage",), None, 16, 1),
    ("stage8_M32", (8,), ("stage",), None, 32, 1),
    ("stage4_data2_M4", (4, 2), ("stage", "data"), "data", 4, 1),
    ("stage4_data2_M7", (4, 2), ("stage", "data"), "data", 7, 1),
    ("stage4_data2_M8", (4, 2), ("stage", "data"), "data", 8, 1),
    ("stage4_data2_M16", (4, 2), ("stage", "data"), "data", 16, 1),
    ("stage2_fsdp4_M2", (2, 4), ("stage", "fsdp"), "fsdp", 2, 1),
    ("stage2_fsdp4_M4", (2, 4), ("stage", "fsdp"), "fsdp", 4, 1),
    ("stage2_fsdp4_M8", (2, 4), ("stage", "fsdp"), "fsdp", 8, 1),
)
# schedule="zero-bubble" (R = 1): M = 1, S - 1, S, 2 S - 1, 4 S (M = 7 and
# 3: not multiples of S) over the three meshes (zero_bubble_checks.py).
ZERO_BUBBLE = (
    ("stage8_M7", (8,), ("stage",), None, 7, 1),
    ("stage8_M32", (8,), ("stage",), None, 32, 1),
    ("stage4_data2_M1", (4, 2), ("stage", "data"), "data", 1, 1),
    ("stage4_data2_M4", (4, 2), ("stage", "data"), "data", 4, 1),
    ("stage4_data2_M7", (4, 2), ("stage", "data"), "data", 7, 1),
    ("stage4_data2_M16", (4, 2), ("stage", "data"), "data", 16, 1),
    ("stage2_fsdp4_M1", (2, 4), ("stage", "fsdp"), "fsdp", 1, 1),
    ("stage2_fsdp4_M3", (2, 4), ("stage", "fsdp"), "fsdp", 3, 1),
    ("stage2_fsdp4_M8", (2, 4), ("stage", "fsdp"), "fsdp", 8, 1),
)
# schedule="1f1b" with R > 1 (interleaved, interleaved_checks.py): M = S,
# 2S, 4S, 7 and M < S on stage=4 x data=2 (R = 2); M = S, 2S on stage=8
# (R = 2: 16 model stages); M = 5 (R = 3) and 4S (R = 4) on stage=2 x fsdp=4.
INTERLEAVED = (
    ("stage8_M8_R2", (8,), ("stage",), None, 8, 2),
    ("stage8_M16_R2", (8,), ("stage",), None, 16, 2),
    ("stage4_data2_M3_R2", (4, 2), ("stage", "data"), "data", 3, 2),
    ("stage4_data2_M4_R2", (4, 2), ("stage", "data"), "data", 4, 2),
    ("stage4_data2_M7_R2", (4, 2), ("stage", "data"), "data", 7, 2),
    ("stage4_data2_M8_R2", (4, 2), ("stage", "data"), "data", 8, 2),
    ("stage4_data2_M16_R2", (4, 2), ("stage", "data"), "data", 16, 2),
    ("stage2_fsdp4_M5_R3", (2, 4), ("stage", "fsdp"), "fsdp", 5, 3),
    ("stage2_fsdp4_M8_R4", (2, 4), ("stage", "fsdp"), "fsdp", 8, 4),
)
EXACT_BY_NAME = {
    case[0]: case for case in (*EXACT, *ONE_F_ONE_B, *ZERO_BUBBLE, *INTERLEAVED)
}
AUTO = "stage4_data2_M4_R2"

CHECKS = [
    *(f"exact_{case[0]}" for case in EXACT if case[0] not in (AUTO, "stage8_M3")),
    f"auto_mesh_{AUTO}",
    "float64_stage4_data2_M8_R2",
    "nan_bubble_fill_R2",
    "nan_on_zero_input_stage",
    "weighted_aux_keys_any_schedule",
    "sum_reduction",
    "bfloat16_stage_params",
    "report_stats",
    "loss_scale_over_stages_and_shards",
    "bubble_and_nested_flops",
    "memory_per_device",
    "plan_pipeline_stage4_data2",
    "transformer_loss_curve",
    # One check a layout (the instruction-set reruns take one a mesh).
    *(f"1f1b_exact_{case[0]}" for case in ONE_F_ONE_B),
    "1f1b_float64",
    "1f1b_nan_bubbles_skipped_and_masked",
    "1f1b_weighted_aux_keys",
    "1f1b_sum_reduction",
    "1f1b_bfloat16_stage_params",
    "1f1b_loss_scale",
    "1f1b_report_stats",
    "1f1b_memory_flat_in_M",
    "1f1b_flops",
    *(f"zero_bubble_exact_{case[0]}" for case in ZERO_BUBBLE),
    "zero_bubble_float64",
    "zero_bubble_nan_bubbles_skipped_and_masked",
    "zero_bubble_weighted_aux_keys",
    "zero_bubble_sum_reduction",
    "zero_bubble_bfloat16_stage_params",
    "zero_bubble_loss_scale",
    "zero_bubble_report_stats",
    "zero_bubble_drawn_options_agree",
    "zero_bubble_memory_and_slots",
    "interleaved_exact_matrix",
    "interleaved_float64",
    "interleaved_nan_bubbles_skipped_and_masked",
    "interleaved_weighted_aux_keys",
    "interleaved_sum_reduction",
    "interleaved_bfloat16_stage_params",
    "interleaved_loss_scale",
    "interleaved_report_stats",
    "interleaved_drawn_options_agree",
    "interleaved_against_1f1b",
    "interleaved_memory_and_flops",
    "interleaved_no_parameter_copies",
    "interleaved_device_order_reads_chunks_statically",
    "interleaved_device_order_fsdp_R3",
    "plan_pipeline_device_order",
    "interleaved_device_order_circular_gpipe_auto_mesh",
]


# The model: an embedding, LAYERS of tanh(x Q + b), a linear head, MSE.


def embed_fn(params, micro_batch, key=None):
    x = micro_batch["x"] @ params["w"]
    if key is not None:  # additive noise keeps every layer 1-Lipschitz
        x = x + 0.1 * jax.random.normal(key, x.shape, x.dtype)
    return x


def stage_fn(params, x, key=None):
    w, b = (params[name].astype(x.dtype) for name in "wb")
    x = jnp.tanh(x @ w + b)
    if key is not None:
        x = x + 0.1 * jax.random.normal(key, x.shape, x.dtype)
    return x


def loss_fn(params, x, micro_batch):
    return jnp.mean((x @ params["w"] - micro_batch["y"]) ** 2)


def sequential(stage, loss, params, batch):
    """The model on the whole batch, one stage after another."""
    embed, stages, head = params
    x = embed_fn(embed, batch)
    for layer in range(jax.tree.leaves(stages)[0].shape[0]):
        x = stage(jax.tree.map(lambda p, i=layer: p[i], stages), x)
    return loss(head, x, batch)


def normal(rng, shape, scale=1.0, dtype=np.float32):
    """Test data from NumPy (eager jax.random would compile per shape)."""
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def orthogonal(rng, size, count, dtype=np.float32):
    """``count`` random orthogonal ``size x size`` matrices (1-Lipschitz)."""
    q, r = np.linalg.qr(rng.standard_normal((count, size, size)))
    return jnp.asarray(q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None], dtype)


def make_params(layers, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    embed = {"w": normal(rng, (INPUTS, FEATURES), INPUTS**-0.5, dtype)}
    stages = {
        "w": orthogonal(rng, FEATURES, layers, dtype),
        "b": normal(rng, (layers, FEATURES), 0.1, dtype),
    }
    head = {"w": normal(rng, (FEATURES, OUTPUTS), FEATURES**-0.5, dtype)}
    return embed, stages, head


def make_batch(rows, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": normal(rng, (rows, INPUTS), dtype=dtype),
        "y": normal(rng, (rows, OUTPUTS), dtype=dtype),
        "weight": jnp.asarray(rng.random(rows) < 0.6, dtype),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    """One pipelined configuration, its mesh and its sharded arguments."""

    mesh: jax.sharding.Mesh
    data_axis: str | None
    num_microbatches: int
    repeats: int
    params: tuple
    batch: dict
    placed: tuple  # (params, batch) as the step gets them
    schedule: str = "gpipe"

    @property
    def num_stages(self):
        return self.mesh.shape["stage"]

    @property
    def shards(self):
        return self.mesh.shape[self.data_axis] if self.data_axis else 1

    @property
    def ticks(self):
        if self.schedule == "1f1b" and self.repeats > 1:  # interleaved
            return Interleaved(
                self.num_stages, self.num_microbatches, self.repeats
            ).num_ticks
        if self.schedule == "zero-bubble":  # the loop's: the ticks with permutes
            return ZeroBubble(self.num_stages, self.num_microbatches).loop_ticks
        if self.schedule == "1f1b":
            return self.num_microbatches + 2 * (self.num_stages - 1)
        return self.num_microbatches * self.repeats + self.num_stages - 1

    @property
    def layers(self):
        """The bound's chain: LAYERS, or the case's model stages if more."""
        return max(LAYERS, self.num_stages * self.repeats)

    @property
    def rows(self):
        return len(self.batch["x"])


def param_specs(fsdp_axis):
    """Stages over "stage" on axis 0; with FSDP, every weight also over the
    data axis on another dimension (biases too)."""
    if fsdp_axis is None:
        return (P(), P("stage"), P())
    return (
        {"w": P(fsdp_axis)},
        {"w": P("stage", fsdp_axis), "b": P("stage", fsdp_axis)},
        {"w": P(fsdp_axis)},
    )


def make_case(name, dtype=np.float32, axis_type=AxisType.Explicit, schedule="gpipe"):
    _, shape, axes, data_axis, num, repeats = EXACT_BY_NAME[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(shape))
    stages = shape[0]
    shards = shape[1] if len(shape) > 1 else 1
    params = make_params(stages * repeats, dtype)
    batch = make_batch(ROWS * num * shards, dtype)
    fsdp = data_axis if data_axis == "fsdp" else None
    placed_params = jax.device_put(  # from the host: no resharding to compile
        jax.tree.map(np.asarray, params),
        jax.tree.map(
            lambda spec: NamedSharding(mesh, spec),
            param_specs(fsdp),
            is_leaf=lambda x: isinstance(x, P),
        ),
    )
    placed_batch = jax.device_put(
        jax.tree.map(np.asarray, batch), NamedSharding(mesh, P(data_axis))
    )
    placed = (placed_params, placed_batch)
    return Case(mesh, data_axis, num, repeats, params, batch, placed, schedule)


def pipelined(case, stage=stage_fn, loss=loss_fn, **options):
    return jaxaccum.pipeline_value_and_grad(
        stage,
        loss,
        case.num_microbatches,
        mesh=case.mesh,
        embed_fn=embed_fn,
        repeats=case.repeats,
        data_axis=case.data_axis,
        schedule=case.schedule,
        **options,
    )


def compiled_run(step, *args):
    """The compiled step and its result (compiled once)."""
    compiled = jax.jit(step).lower(*args).compile()
    return compiled, compiled(*args)


@functools.cache
def reference_step(stage=stage_fn, loss=loss_fn):
    """The sequential model's jitted ``value_and_grad``, one a (stage, loss):
    the cases of the same shapes and dtype share its compilation."""
    return jax.jit(jax.value_and_grad(functools.partial(sequential, stage, loss)))


def reference(case, stage=stage_fn):
    return reference_step(stage)(case.params, case.batch)


# What a compile-only check reads (memory_analysis, cost_analysis, the
# collectives) is decided by XLA's HLO passes; the backend's optimisation
# level changes only the machine code, which such a check never runs, so it
# compiles at level 0 (same bytes and FLOPs, a fraction of the compile time).
READ_ONLY = {"xla_backend_optimization_level": 0}


def compile_to_read(lowered):
    """A program compiled to be read, never run (READ_ONLY)."""
    return lowered.compile(compiler_options=READ_ONLY)


@contextlib.contextmanager
def compiles_to_read():
    """Within, ``Lowered.compile()`` compiles READ_ONLY: for plan_pipeline,
    which compiles each window only to read its memory and FLOPs."""
    compile_as_given = jax.stages.Lowered.compile

    def read_only(lowered, compiler_options=None, **kwargs):
        return compile_as_given(lowered, compiler_options or READ_ONLY, **kwargs)

    with unittest.mock.patch.object(jax.stages.Lowered, "compile", read_only):
        yield


def check_shardings(grads, params):
    for (path, grad), param in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree.leaves(params),
        strict=True,
    ):
        assert grad.dtype == param.dtype, (jax.tree_util.keystr(path), grad.dtype)
        assert grad.sharding.is_equivalent_to(param.sharding, param.ndim), (
            f"grads{jax.tree_util.keystr(path)}: {grad.sharding.spec}, "
            f"parameter {param.sharding.spec}"
        )


def activation_bytes(case, dtype_bytes=4):
    return ROWS * FEATURES * dtype_bytes


def check_collectives(case, compiled):
    """In the loop: only the two collective-permutes (the activation forward,
    its cotangent backward), one activation each. Outside: the gradient
    reductions, once per window; all-gathers and all-to-alls only of
    parameters (FSDP gathered once; R > 1 relays the stages out)."""
    found = find_collectives(compiled)
    in_loop = [c for c in found if c.in_loop]
    assert [c.op for c in in_loop] == ["collective-permute"] * 2, in_loop
    for c in in_loop:
        assert c.bytes == activation_bytes(case), (c, activation_bytes(case))
    fsdp = case.data_axis == "fsdp"
    moved = [c for c in found if c.op in ("all-gather", "all-to-all")]
    if case.repeats == 1 and not fsdp:
        assert not moved, moved
    # Outside: the stages relaid out for R > 1 (in, and their gradients out),
    # FSDP shards gathered once: at most twice the parameters, whatever M.
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(case.params))
    assert sum(c.bytes for c in moved) <= 2 * param_bytes, (moved, param_bytes)
    reductions = [c for c in found if c.op in ("all-reduce", "reduce-scatter")]
    assert reductions and all(c.dtypes == ("f32",) * len(c.dtypes) for c in reductions)
    totals = collective_bytes(compiled)
    # window_bytes counts each loop by the trip count the HLO states: the
    # pipeline's ticks, not its M (issue 45, case 5: it took N for the loop).
    assert all(c.runs == case.ticks for c in in_loop), (in_loop, case.ticks)
    moved_bytes = window_bytes(compiled)
    expected = sum(t["outside"] + case.ticks * t["loop"] for t in totals.values())
    assert moved_bytes == expected, (moved_bytes, expected)
    return (
        f"loop permutes {len(in_loop)} x {activation_bytes(case)} B; outside "
        f"{sorted({c.op for c in found if not c.in_loop})}; all-reduce "
        f"{totals['all-reduce']['outside']} B, reduce-scatter "
        f"{totals['reduce-scatter']['outside']} B; window {moved_bytes} B"
    )


def max_error(out, expected):
    """In NumPy: eager jnp on the step's sharded outputs compiles each op for
    each leaf's shape and sharding (a second a check)."""
    out, expected = jax.device_get((out, expected))
    return max(
        float(np.max(np.abs(np.subtract(a, b, dtype=np.result_type(a, b)))))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True)
    )


def check_exact(name, axis_type=AxisType.Explicit, schedule="gpipe"):
    """Equal to the sequential model (the bound for the case's rows);
    gradients sharded as the parameters (on an Auto mesh too, where the step
    cannot see their shardings and keeps the stages' over the stage axis);
    the loop's collectives."""
    case = make_case(name, axis_type=axis_type, schedule=schedule)
    compiled, out = compiled_run(pipelined(case), *case.placed)
    expected = reference(case)
    rtol = tolerance(UNIT_ROUNDOFF, layers=case.layers, batch=max(case.rows, BATCH))
    chex.assert_trees_all_close(out, expected, rtol=rtol, atol=rtol)
    check_shardings(out[1], case.placed[0])
    return f"max error {max_error(out, expected):.2e} (tol {rtol:.1e}); " + (
        check_collectives(case, compiled)
    )


def check_float64(name, schedule="gpipe"):
    jax.config.update("jax_enable_x64", True)
    try:
        case = make_case(name, np.float64, schedule=schedule)
        out = jax.jit(pipelined(case))(*case.placed)
        expected = reference(case)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(out))
        rtol = tolerance(2.0**-53, layers=case.layers, batch=max(case.rows, BATCH))
        chex.assert_trees_all_close(out, expected, rtol=rtol, atol=rtol)
        error = max_error(out, expected)
    finally:
        jax.config.update("jax_enable_x64", False)
    return f"max error {error:.2e} (tol {rtol:.1e})"


def nan_at_zero_stage(params, x):
    """``stage_fn`` plus a term that is exactly 0 on a row that is not all
    zeros and NaN, value and derivatives, on one that is: the bubbles' fill."""
    log_norm = jnp.log(jnp.sum(x * x, -1, keepdims=True))
    return stage_fn(params, x) + (log_norm - log_norm)


def check_nan(fill, stage, name="stage4_data2_M8_R2", schedule="gpipe", skip=True):
    """Bubbles poisoned with NaN, by their fill or by a stage that makes
    NaN of it: the gradient is finite and exact. GPipe with R = 2 and M > S:
    bubbles also pass through the recirculation buffer; 1F1B with its bubble
    slots skipped or computed (on the fill, their stage's ring slot left
    stale) and selected away."""
    case = make_case(name, schedule=schedule)
    bubble = stage(jax.tree.map(lambda p: p[0], case.params[1]), jnp.zeros((1, 16)))
    assert fill != 0 or bool(jnp.isnan(bubble).all()), "no NaN to contain"
    layout = PipelineLayout(
        data_axis=case.data_axis, repeats=case.repeats, schedule=schedule
    )
    options = PipelineWindow(case.num_microbatches, layout=layout)
    functions = (stage, loss_fn, embed_fn)
    step = make_pipeline(functions, options, case.mesh, fill, skip)
    out = jax.jit(step)(*case.placed)
    chex.assert_tree_all_finite(out)
    chex.assert_trees_all_close(out, reference(case, stage), rtol=RTOL, atol=ATOL)
    return f"fill {fill}: finite and exact"


# Reductions, aux and keys.

EMBED_KEY, HEAD_KEY = "embed", "head"  # see pipeline_value_and_grad's Returns


# The poisons a window's NaN check feeds: a skipped slot on a stage that
# makes NaN from zeros, a masked slot on a NaN fill, a masked slot on that
# stage.
NAN_CASES = (
    (True, 0.0, nan_at_zero_stage),
    (False, float("nan"), stage_fn),
    (False, 0.0, nan_at_zero_stage),
)


def check_nan_cases(name: str, schedule: str, cases=NAN_CASES) -> str:
    """:func:`check_nan` on layout ``name`` under ``schedule`` for each
    ``(skip, fill, stage)`` of ``cases``; what was fed, for the report."""
    details = []
    for skip, fill, stage in cases:
        check_nan(fill, stage, name, schedule, skip)
        poison = "NaN fill" if fill != 0 else "NaN-making stage"
        details.append(f"{'skipped' if skip else 'masked'}, {poison}")
    return ", ".join(details) + ": finite and exact"


def weighted_loss(params, x, micro_batch, key):
    per_row = jnp.sum((x @ params["w"] - micro_batch["y"]) ** 2, -1)
    weight = micro_batch["weight"] * (1 + jax.random.uniform(key, per_row.shape))
    aux = {"worst": jnp.max(per_row), "rows": jnp.sum(micro_batch["weight"])}
    return (jnp.sum(weight * per_row), jnp.sum(weight)), aux


def piece_rows(num, shards, rows):
    """``(shards * num, rows)``: the global rows of data shard ``j``'s
    micro-batch ``k`` (its local rows ``k, k + num, ...``), at ``j num + k``."""
    local = num * rows
    return (
        local * np.arange(shards)[:, None, None]
        + np.arange(num)[None, :, None]
        + num * np.arange(rows)[None, None, :]
    ).reshape(shards * num, rows)


def piece_keys(key, num, shards):
    """Micro-batch ``k``'s key on data shard ``j``, as the pipeline draws it."""
    if shards == 1:
        return jax.random.split(key, num)
    return jnp.concatenate(
        [jax.random.split(jax.random.fold_in(key, j), num) for j in range(shards)]
    )


@functools.partial(jax.jit, static_argnums=(3, 4))
def weighted_reference(params, batch, key, num, shards):
    """The window's weighted mean, aux mean and gradient, one piece (data
    shard, micro-batch) at a time, with the keys the documentation gives:
    the pipeline's, whatever the schedule."""
    layers = params[1]["w"].shape[0]

    def piece_sums(params, piece, piece_key):
        embed, stages, head = params
        x = embed_fn(embed, piece, jax.random.fold_in(piece_key, layers))
        for layer in range(layers):
            x = stage_fn(
                jax.tree.map(lambda p, i=layer: p[i], stages),
                x,
                jax.random.fold_in(piece_key, layer),
            )
        (loss_sum, weight), aux = weighted_loss(
            head, x, piece, jax.random.fold_in(piece_key, layers + 1)
        )
        return loss_sum, (weight, aux)

    rows = piece_rows(num, shards, jax.tree.leaves(batch)[0].shape[0] // (num * shards))
    pieces = jax.tree.map(lambda leaf: leaf[rows], batch)
    (sums, (weights, aux)), grads = jax.vmap(
        jax.value_and_grad(piece_sums, has_aux=True), in_axes=(None, 0, 0)
    )(params, pieces, piece_keys(key, num, shards))
    total = jnp.sum(weights)
    grads = jax.tree.map(lambda g: jnp.sum(g, 0) / total, grads)
    aux = jax.tree.map(lambda a: jnp.mean(a, 0), aux)
    return (jnp.sum(sums) / total, aux), grads


def check_weighted_aux_keys(schedule="gpipe", interleaved=False):
    """reduction="weighted" (token-exact: the weights are uneven), has_aux
    (means over micro-batches and shards) and keys in every function, on two
    layouts of the same 4 layers (stage=4 x data=2, R=1; stage=2 x data=2,
    R=2: GPipe, and "1f1b" there when ``interleaved``): each equals the
    reference drawn with the documented keys, so a micro-batch's randomness
    depends on it and its layer, not on the schedule, the tick or the device
    that runs it."""
    key = jax.random.key(7)
    details = []
    layouts = (((4, 2), 1, None), ((2, 2), 2, jax.devices()[:4]))
    if interleaved:
        layouts = layouts[1:]
    elif schedule != "gpipe":
        layouts = layouts[:1]
    for shape, repeats, devices in layouts:
        mesh = jax.make_mesh(shape, ("stage", "data"), devices=devices)
        num = 4
        params = make_params(4)
        batch = make_batch(ROWS * num * 2)
        step = jaxaccum.pipeline_value_and_grad(
            stage_fn,
            weighted_loss,
            num,
            mesh=mesh,
            embed_fn=embed_fn,
            repeats=repeats,
            data_axis="data",
            reduction="weighted",
            has_aux=True,
            schedule=schedule,
        )
        out = jax.jit(step)(params, batch, key)
        expected = weighted_reference(params, batch, key, num, 2)
        chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL)
        details.append(f"S={shape[0]} R={repeats}: loss {float(out[0][0]):.6f}")
    return "; ".join(details)


REMATS = (False, True, jax.checkpoint_policies.dots_saveable)


def check_drawn_against(schedule, other, names, max_examples, rtol_of, remats=REMATS):
    """Drawn (case of ``names``, remat of ``remats``, unroll): ``schedule``
    equals the sequential model (``rtol_of(case)``) and ``other`` on the
    same options (twice it: each is that close to the model). Returns what
    it drew."""
    seen = []

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    @given(
        name=st.sampled_from(names),
        remat=st.sampled_from(remats),
        unroll=st.sampled_from([1, 2]),
    )
    def drawn(name, remat, unroll):
        case = make_case(name, schedule=schedule)
        outs = {
            kind: jax.jit(
                pipelined(
                    dataclasses.replace(case, schedule=kind), remat=remat, unroll=unroll
                )
            )(*case.placed)
            for kind in (schedule, other)
        }
        rtol = rtol_of(case)
        expected = reference(case)
        chex.assert_trees_all_close(outs[schedule], expected, rtol=rtol, atol=rtol)
        chex.assert_trees_all_close(
            outs[schedule], outs[other], rtol=2 * rtol, atol=2 * rtol
        )
        error = max_error(outs[schedule], expected)
        remat_name = getattr(remat, "__name__", remat)
        seen.append(f"{name} remat={remat_name} unroll={unroll}: {error:.1e}")

    drawn()
    return "; ".join(seen)


def check_sum_reduction(schedule="gpipe", name="stage8_M3"):
    case = make_case(name, schedule=schedule)

    def sum_loss(params, x, micro_batch):
        return jnp.sum((x @ params["w"] - micro_batch["y"]) ** 2)

    out = jax.jit(pipelined(case, loss=sum_loss, reduction="sum"))(*case.placed)
    expected = jax.jit(
        jax.value_and_grad(functools.partial(sequential, stage_fn, sum_loss))
    )(case.params, case.batch)
    rows = case.batch["x"].shape[0]  # a sum of rows terms of unit scale
    chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=ATOL * rows)
    return f"sum {float(out[0]):.4f}"


def check_bfloat16(schedule="gpipe", name="stage4_data2_M7"):
    """bfloat16 stage parameters: bfloat16 gradients within a bound derived
    per element, reduced in float32 (the HLO JAX emits; XLA:CPU promotes
    bfloat16 collectives itself).

    bfloat16 keeps 8 significant bits. The loss sees the bfloat16 weights
    (stage_fn computes in the activations' float32), so the reference
    differentiates them upcast. Two roundings remain: each piece's (data
    shard, micro-batch) gradient of each stage is rounded to bfloat16 at its
    tick (2^-8 |g_p|, 2^-8 mean_p |g_p| in the mean), and the float32 mean
    is rounded once at the end (2^-8 of |G| plus the first error). The
    float32 sums add RTOL, ATOL."""
    case = make_case(name, schedule=schedule)
    params, placed = (
        (tree[0], jax.tree.map(lambda p: p.astype(jnp.bfloat16), tree[1]), tree[2])
        for tree in (case.params, case.placed[0])
    )
    step = pipelined(case)
    out = jax.jit(step)(placed, case.placed[1])
    emitted = jax.jit(step).lower(placed, case.placed[1]).as_text(dialect="hlo")
    low = [
        c
        for c in find_collectives(emitted)
        if c.op in ("all-reduce", "reduce-scatter") and set(c.dtypes) != {"f32"}
    ]
    assert not low, f"reductions not in float32: {low}"
    upcast = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    value, grads = reference(dataclasses.replace(case, params=upcast))
    chex.assert_trees_all_close(out[0], value, rtol=RTOL, atol=ATOL)
    rows = piece_rows(case.num_microbatches, case.shards, ROWS)
    pieces = jax.tree.map(lambda leaf: leaf[rows], case.batch)
    piece_grads = jax.vmap(
        jax.grad(functools.partial(sequential, stage_fn, loss_fn)), in_axes=(None, 0)
    )(upcast, pieces)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(out[1][1]))
    worst = 0.0
    for got, want, piece in zip(
        jax.tree.leaves(out[1][1]),
        jax.tree.leaves(grads[1]),
        jax.tree.leaves(piece_grads[1]),
        strict=True,
    ):
        mean_abs = jnp.mean(jnp.abs(piece), 0)
        bound = (2**-8 * (1 + 2**-8) + RTOL) * (jnp.abs(want) + mean_abs) + ATOL
        error = jnp.abs(got.astype(jnp.float32) - want)
        assert bool(jnp.all(error <= bound)), float(jnp.max(error / bound))
        worst = max(worst, float(jnp.max(error / bound)))
    return f"error <= {worst:.3f} x bound; reductions float32"


def check_loss_scale(name="stage4_data2_M8_R2", schedule="gpipe"):
    """A float32 window under a power-of-two loss scale is the unscaled
    window bitwise (the scale multiplies every cotangent exactly, the unscale
    divides it back); one inf row, in data shard 1's last micro-batch, makes
    the window not finite on every device, the scale backed off."""
    case = make_case(name, schedule=schedule)
    scale = jaxaccum.dynamic_loss_scale()
    step = jax.jit(pipelined(case, loss_scale=True))
    out, report = step(*case.placed, loss_scale=scale)
    assert bool(report.finite)
    chex.assert_trees_all_equal(out, jax.jit(pipelined(case))(*case.placed))
    params, batch = case.placed
    row = len(case.batch["x"]) - 1  # shard 1's last row: micro-batch M - 1
    poisoned = jax.device_put(
        {**case.batch, "x": case.batch["x"].at[row].set(np.inf)},
        NamedSharding(case.mesh, P(case.data_axis)),
    )
    _, report = step(params, poisoned, loss_scale=scale)
    flags = [bool(shard.data) for shard in report.finite.addressable_shards]
    assert len(flags) == 8 and not any(flags), flags
    assert float(report.loss_scale.loss_scale) < float(scale.loss_scale)
    return f"finite windows bitwise; an inf row: not finite on {len(flags)} devices"


def check_report_stats(name="stage4_data2_M8_R2", schedule="gpipe"):
    """WindowStats from per-micro-batch squared norms (data shard j's piece of
    micro-batch k, each stage's gradient taken at its tick) equal those of the
    per-piece gradients computed one at a time. A squared norm of gradients
    within RTOL |g| + ATOL per coordinate is within 2 |g| e + e^2 (e that
    error's norm), plus its own float32 sum of n squares (2 n u)."""
    case = make_case(name, schedule=schedule)
    (_, grads), stats = jax.jit(pipelined(case, report_stats=True))(*case.placed)
    rows = piece_rows(case.num_microbatches, case.shards, ROWS)
    pieces = jax.tree.map(lambda leaf: leaf[rows], case.batch)
    piece_grads = jax.vmap(
        jax.grad(functools.partial(sequential, stage_fn, loss_fn)), in_axes=(None, 0)
    )(case.params, pieces)
    flat = jnp.concatenate(
        [g.reshape(g.shape[0], -1) for g in jax.tree.leaves(piece_grads)], 1
    )
    count = flat.shape[1]

    def bound(norm):
        error = RTOL * norm + ATOL * count**0.5
        return 2 * norm * error + error**2 + 2 * count * UNIT_ROUNDOFF * norm**2

    piece_norms = jnp.linalg.norm(flat, axis=1).reshape(case.shards, -1)
    want_micro = jnp.mean(piece_norms**2, 0)
    window = jnp.linalg.norm(jnp.mean(flat, 0))
    chex.assert_trees_all_close(
        stats.microbatch_grad_sq_norm,
        want_micro,
        atol=jnp.max(jnp.mean(bound(piece_norms), 0)),
    )
    chex.assert_trees_all_close(stats.grad_sq_norm, window**2, atol=bound(window))
    size = float(ROWS * case.shards)
    chex.assert_trees_all_equal(
        stats.small_batch, jnp.full(case.num_microbatches, size)
    )
    chex.assert_trees_all_equal(
        stats.big_batch, jnp.float32(size * case.num_microbatches)
    )
    assert bool(stats.finite) and stats.microbatch_finite.shape == (
        case.num_microbatches,
    )
    return (
        f"|G_B|^2 {float(stats.grad_sq_norm):.5f}, noise scale "
        f"{float(stats.noise_scale):.3f}"
    )


# The compiled program's cost: FLOPs against the bubble, memory per device.

# Stages that dominate the FLOPs, 128 rows (tokens) per micro-batch: the
# per-tick elementwise work on a stage's gradient is ~R P against the stage's
# 6 tokens P, so it shrinks as micro-batches grow (real ones hold thousands).
WIDE, WIDE_ROWS = 128, 128


def wide_case(stages, num, repeats=1):
    """A model of ``stages * repeats`` 128-wide layers (a 4-wide embedding, a
    1-wide head) on the first ``stages`` devices, stages placed."""
    mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
    rng = np.random.default_rng(3)
    params = (
        {"w": normal(rng, (INPUTS, WIDE), INPUTS**-0.5)},
        {
            "w": orthogonal(rng, WIDE, stages * repeats),
            "b": jnp.zeros((stages * repeats, WIDE)),
        },
        {"w": normal(rng, (WIDE, 1), WIDE**-0.5)},
    )
    rows = WIDE_ROWS * num
    batch = {"x": normal(rng, (rows, INPUTS)), "y": normal(rng, (rows, 1))}
    shardings = (P(), P("stage"), P())
    placed = jax.device_put(
        params, tuple(NamedSharding(mesh, spec) for spec in shardings)
    )
    return Case(mesh, None, num, repeats, params, batch, (placed, batch))


def program_flops(case, **options):
    """FLOPs of the whole window over all devices: XLA counts a loop's body
    once whatever its trip count, so the scan is unrolled here."""
    step = pipelined(case, unroll=True, **options)
    compiled = compile_to_read(jax.jit(step).lower(*case.placed))
    return compiled.cost_analysis()["flops"] * case.num_stages


def sequential_flops(case):
    lowered = reference_step().lower(case.params, case.batch)
    return compile_to_read(lowered).cost_analysis()["flops"]


def check_flops():
    """The window's FLOPs over all devices against the sequential model's (one
    device, same batch): (M R + S - 1) / (M R) within 5%, for M < S, M = S,
    M > S and R = 2. What is left beyond the formula is per-tick elementwise
    work (the masks, the stage's gradient accumulated), and the embedding and
    head counted on every device (XLA counts a conditional at its larger
    branch), all small next to a stage's FLOPs.

    And at the same global batch, the window as the pipeline (one fill and
    drain) against MaxText's layout, accumulation around the pipeline: A
    steps, each a pipeline of M / A micro-batches (A times its FLOPs; here
    the M = 2 and M = 1 windows, on their share of the batch). Fewer FLOPs
    for A = 2 and 4, each layout near its formula (M + A (S - 1)) / M."""
    stages, num = 4, 4
    ratios, flops = {}, {}
    for micro, repeats in ((1, 1), (2, 1), (4, 1), (4, 2)):
        case = wide_case(stages, micro, repeats)
        flops[micro, repeats] = program_flops(case)
        ratio = flops[micro, repeats] / sequential_flops(case)
        formula = (micro * repeats + stages - 1) / (micro * repeats)
        assert abs(ratio / formula - 1) <= 0.05, (micro, repeats, ratio, formula)
        ratios[micro, repeats] = f"{ratio:.4f} vs {formula:.4f}"
    base = sequential_flops(wide_case(stages, num))
    nested = {}
    for steps in (2, 4):
        nested[steps] = steps * flops[num // steps, 1]
        formula = (num + steps * (stages - 1)) / num
        assert nested[steps] > flops[num, 1], (steps, nested, flops)
        assert abs(nested[steps] / base / formula - 1) <= 0.05, (steps, formula)
    return (
        f"S={stages}: "
        + ", ".join(f"M={m} R={r}: {v}" for (m, r), v in ratios.items())
        + f"; nested A=2: {nested[2] / base:.4f}, A=4: {nested[4] / base:.4f}"
        + f" against the window's {flops[num, 1] / base:.4f}"
    )


def check_memory():
    """remat=True is exact. Per device: arguments hold 1/S of the stage
    parameters (the batch, the embedding and the head whole); temporaries
    grow linearly with M (GPipe keeps every tick's activations for the
    backward pass; checked at three M with remat, two without). With remat, an
    extra micro-batch (one more tick) keeps 5 activations: the stage's input,
    its entering and leaving activation as the loop's input and output at
    that tick, and the embedded and leaving micro-batch stacked for the
    conditionals before and after the loop; without, also what the stage
    saves inside (here its tanh)."""
    stages = 4
    temps = {}
    for remat, num in ((False, 4), (False, 8), (True, 4), (True, 8), (True, 12)):
        case = wide_case(stages, num)
        lowered = jax.jit(pipelined(case, remat=remat)).lower(*case.placed)
        memory = compile_to_read(lowered).memory_analysis()
        temps[remat, num] = memory.temp_size_in_bytes
    # The remat=True window (GPipe, stages rematerialised) is exact, within
    # the bound above for this model's sizes.
    rtol = tolerance(UNIT_ROUNDOFF, stages, WIDE, WIDE_ROWS * num)
    chex.assert_trees_all_close(
        lowered.compile()(*case.placed), reference(case), rtol=rtol, atol=rtol
    )
    embed, stage_params, head = case.params
    whole = sum(x.nbytes for x in jax.tree.leaves((embed, head, case.batch)))
    stage_bytes = sum(x.nbytes for x in jax.tree.leaves(stage_params))
    assert memory.argument_size_in_bytes == whole + stage_bytes // stages, (
        memory.argument_size_in_bytes,
        whole,
        stage_bytes,
    )
    activation = WIDE_ROWS * WIDE * 4
    steps = [(temps[True, b] - temps[True, a]) / 4 for a, b in ((4, 8), (8, 12))]
    assert abs(steps[1] / steps[0] - 1) <= 0.1, steps  # linear in M
    per_micro = {
        remat: (temps[remat, 8] - temps[remat, 4]) / 4 / activation
        for remat in (False, True)
    }
    assert per_micro[True] <= 5 + 0.5, per_micro  # + scalars per tick
    assert per_micro[True] < per_micro[False], per_micro
    return (
        f"stage params {stage_bytes // stages} B of {stage_bytes} B; per extra "
        f"micro-batch {per_micro[False]:.2f} activations, {per_micro[True]:.2f} "
        "with remat"
    )


# A small transformer, trained pipelined and not.

VOCAB, LENGTH, WIDTH, BLOCKS, STEPS, LEARNING_RATE = 11, 8, 16, 2, 4, 0.5
# Float64: 2 u (a gradient's chain of 2 * 6 * BLOCKS + 2 contractions of at
# most 2 WIDTH terms, then the batch's 64 * LENGTH tokens) = 3e-13, with room
# for the attention's softmax and normalisations (not 1-Lipschitz) to amplify.
TRANSFORMER_TOL = 1e-12


def rms_norm(x):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def block(params, x):
    """Pre-norm causal self-attention (one head) and an MLP, residual."""
    q, k, v = jnp.split(rms_norm(x) @ params["qkv"], 3, -1)
    scores = q @ jnp.swapaxes(k, -1, -2) / WIDTH**0.5
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
    scores = jnp.where(causal, scores, -1e9)
    x = x + (jax.nn.softmax(scores) @ v) @ params["out"]
    return x + jnp.tanh(rms_norm(x) @ params["up"]) @ params["down"]


def token_embed(params, micro_batch):
    return params["tokens"][micro_batch["tokens"][:, :-1]] + params["positions"]


def next_token_loss(params, x, micro_batch):
    logits = rms_norm(x) @ params["logits"]
    labels = jax.nn.one_hot(micro_batch["tokens"][:, 1:], VOCAB, dtype=x.dtype)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def transformer_params(dtype):
    rng = np.random.default_rng(5)

    def dense(fan_in, fan_out, scale=1.0):
        return normal(rng, (BLOCKS, fan_in, fan_out), scale * fan_in**-0.5, dtype)

    embed = {
        "tokens": normal(rng, (VOCAB, WIDTH), 0.5, dtype),
        "positions": normal(rng, (LENGTH, WIDTH), 0.1, dtype),
    }
    stages = {
        "qkv": dense(WIDTH, 3 * WIDTH),
        "out": dense(WIDTH, WIDTH, 0.5),
        "up": dense(WIDTH, 2 * WIDTH),
        "down": dense(2 * WIDTH, WIDTH, 0.5),
    }
    head = {"logits": normal(rng, (WIDTH, VOCAB), WIDTH**-0.5, dtype)}
    return embed, stages, head


def counting_batch(rows):
    """Sequences counting modulo VOCAB from a random start by 1 or 2."""
    rng = np.random.default_rng(6)
    start = rng.integers(0, VOCAB, (rows, 1))
    step = rng.integers(1, 3, (rows, 1))
    return {"tokens": jnp.asarray((start + step * np.arange(LENGTH + 1)) % VOCAB)}


@jax.jit
def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def check_transformer():
    """A 2-block transformer trained pipelined (stage=2 x data=4, M=4) for
    STEPS steps of SGD, float64: at every step its loss and gradient equal
    the unpipelined model's at the same parameters, on either schedule (1F1B
    differentiating each Flax block by its own ``jax.vjp``), and its loss
    curve the unpipelined training's."""
    jax.config.update("jax_enable_x64", True)
    try:
        mesh = jax.make_mesh((2, 4), ("stage", "data"))
        params = transformer_params(np.float64)
        batch = counting_batch(ROWS * 4 * 4)
        steps = {
            schedule: jax.jit(
                jaxaccum.pipeline_value_and_grad(
                    block,
                    next_token_loss,
                    4,
                    mesh=mesh,
                    embed_fn=token_embed,
                    data_axis="data",
                    schedule=schedule,
                )
            )
            for schedule in ("gpipe", "1f1b")
        }
        whole = jax.jit(jax.value_and_grad(functools.partial(sequential_transformer)))
        curves = {"pipelined": [], "unpipelined": []}
        plain = params
        for _ in range(STEPS):
            loss, grads = steps["gpipe"](params, batch)
            # The same parameters, off the mesh (sliced layer by layer there).
            expected = whole(jax.device_put(params, jax.devices()[0]), batch)
            for out in ((loss, grads), steps["1f1b"](params, batch)):
                chex.assert_trees_all_close(
                    out, expected, rtol=TRANSFORMER_TOL, atol=TRANSFORMER_TOL
                )
            plain_loss, plain_grads = whole(plain, batch)
            curves["pipelined"].append(float(loss))
            curves["unpipelined"].append(float(plain_loss))
            params, plain = sgd(params, grads), sgd(plain, plain_grads)
    finally:
        jax.config.update("jax_enable_x64", False)
    chex.assert_trees_all_close(
        *curves.values(), rtol=TRANSFORMER_TOL, atol=TRANSFORMER_TOL
    )
    assert curves["pipelined"][-1] < curves["pipelined"][0], curves
    gap = max(abs(a - b) for a, b in zip(*curves.values(), strict=True))
    return f"losses {[round(x, 4) for x in curves['pipelined']]}; gap {gap:.1e}"


def sequential_transformer(params, batch):
    embed, stages, head = params
    x = token_embed(embed, batch)
    for layer in range(BLOCKS):
        x = block(jax.tree.map(lambda p, i=layer: p[i], stages), x)
    return next_token_loss(head, x, batch)


def check_plan_pipeline():
    """plan_pipeline on stage=4 x data=2 (FSDP-free, Explicit; remat=False
    here, the one-device property test draws remat with the schedule): at
    each budget its choice is the most efficient (M, schedule) among every
    one whose compiled footprint fits (the exhaustive search, from the same
    measurement: memory_analysis() of each program); below the smallest
    footprint nothing fits and the error says so; the step built with the
    plan's M, schedule and remat is exact."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    params = jax.device_put(
        make_params(4),
        tuple(NamedSharding(mesh, spec) for spec in param_specs(None)),
    )
    micro = make_batch(ROWS * 2)
    plan = functools.partial(
        jaxaccum.plan_pipeline,
        stage_fn,
        loss_fn,
        params,
        micro,
        mesh=mesh,
        embed_fn=embed_fn,
        data_axis="data",
    )
    table = {}
    schedules = ("gpipe", "1f1b", "zero-bubble")
    with compiles_to_read():
        for schedule, num in itertools.product(schedules, (4, 8, 16)):
            one = plan(
                memory_budget=2**40, candidates=[num], schedule=schedule, remat=False
            )
            table[schedule, False, num] = (one.footprint_bytes, one.efficiency)
        footprints = sorted(footprint for footprint, _ in table.values())
        for budget in (footprints[0], footprints[len(footprints) // 2], footprints[-1]):
            chosen = plan(memory_budget=budget, candidates=(4, 8, 16), remat=False)
            fitting = [e for f, e in table.values() if f <= budget]
            assert chosen.efficiency == max(fitting), (budget, chosen, table)
            key = (chosen.schedule, chosen.remat, chosen.num_microbatches)
            footprint, _ = table[key]
            assert chosen.footprint_bytes == footprint <= budget, (chosen, table)
            assert "<- chosen" in str(chosen)
        try:
            plan(memory_budget=footprints[0] - 1, candidates=(4, 8, 16), remat=False)
        except ValueError as error:
            assert "No window fits" in str(error), error
        else:
            raise AssertionError("a budget below every footprint was planned")
    rows = ROWS * 2 * chosen.num_microbatches
    case = Case(
        mesh, "data", chosen.num_microbatches, 1, make_params(4), make_batch(rows), ()
    )
    case = dataclasses.replace(case, schedule=chosen.schedule)
    step = pipelined(case, remat=chosen.remat)
    batch = jax.device_put(case.batch, NamedSharding(mesh, P("data")))
    rtol = tolerance(UNIT_ROUNDOFF, batch=rows)
    chex.assert_trees_all_close(
        jax.jit(step)(params, batch), reference(case), rtol=rtol, atol=rtol
    )


# 1F1B: schedule="1f1b".


def check_one_f_one_b_exact(name: str) -> str:
    """A layout of ONE_F_ONE_B as check_exact: equal to the sequential model,
    gradients sharded as the parameters, in the loop only the two
    collective-permutes (the activation forward, its cotangent back),
    M + 2 (S - 1) times."""
    return check_exact(name, schedule="1f1b")


def check_one_f_one_b_float64():
    return "; ".join(
        f"{name}: {check_float64(name, '1f1b')}"
        for name in ("stage8_M16", "stage4_data2_M7", "stage2_fsdp4_M4")
    )


def check_one_f_one_b_nan():
    """check_nan on 1F1B: a skipped bubble slot computes nothing (the stage
    that makes NaN of the fill stands for both poisons); a masked one
    computes on the fill, NaN or made NaN, and is selected away."""
    return check_nan_cases("stage4_data2_M7", "1f1b")


def temp_bytes(case, **options):
    lowered = jax.jit(pipelined(case, **options)).lower(*case.placed)
    return compile_to_read(lowered).memory_analysis().temp_size_in_bytes


@functools.cache
def wide_temps(kind: str, remat: bool, stages: int, num: int) -> float:
    """Per-device temporaries of the wide model's step, in activations
    (compiled once a process: the 1F1B and zero-bubble checks share them)."""
    case = dataclasses.replace(wide_case(stages, num), schedule=kind)
    return temp_bytes(case, remat=remat) / (WIDE_ROWS * WIDE * 4)


def check_one_f_one_b_memory():
    """Temporaries per device (memory_analysis), in activations, at S = 4.
    1F1B keeps at most min(2 S - 1, M) micro-batches' stage inputs (remat)
    or residuals: with remat at M = S, 2S, 4S, 8S, flat within 2% from M =
    2 S on (a few scalars per tick: the per-micro-batch losses), less at
    M = S (the ring holds S); without remat flat from 2S to 8S. At 8 S both
    are under half of GPipe with remat's (the issue's bar; GPipe grows by
    about 5 per micro-batch, check_memory). Exactness with remat: the
    one-device property tests draw it."""
    stages = 4
    sizes = (stages, 2 * stages, 4 * stages, 8 * stages)
    big, temps = sizes[-1], {}

    def temps_at(kind: str, remat: bool, num: int) -> float:
        temps[kind, remat, num] = wide_temps(kind, remat, stages, num)
        return temps[kind, remat, num]

    rematted = [temps_at("1f1b", True, num) for num in sizes]
    plain = [temps_at("1f1b", False, num) for num in (2 * stages, big)]
    gpipe = temps_at("gpipe", True, big)
    assert max(rematted[1:]) <= 1.02 * min(rematted[1:]), temps
    assert rematted[0] < rematted[1], temps
    assert max(plain) <= 1.02 * min(plain), temps
    assert max(rematted[-1], plain[-1]) < gpipe / 2, temps
    return ", ".join(
        f"{kind} remat={remat} M={num}: {value:.1f}"
        for (kind, remat, num), value in temps.items()
    )


def check_one_f_one_b_flops():
    """FLOPs over all devices (the scan unrolled), against the sequential
    model's: 1F1B's ticks each hold a forward and a backward slot, M + 2
    (S - 1) of them, (M + 2 (S - 1)) / M within 5% counted statically (XLA
    counts a skipped slot's conditional at its larger branch: the bubble's
    slots, skipped when run, are counted; benchmarks/pipeline.py times
    them). remat=True adds the forward recomputed in each backward slot,
    4/3 of that (a backward twice the forward's FLOPs), as GPipe's."""
    stages, ratios = 4, {}
    for num, remat in ((4, False), (8, False), (4, True)):
        case = dataclasses.replace(wide_case(stages, num), schedule="1f1b")
        base = sequential_flops(case)
        ratio = program_flops(case, remat=remat) / base
        formula = (num + 2 * (stages - 1)) / num * (4 / 3 if remat else 1)
        assert abs(ratio / formula - 1) <= 0.05, (num, remat, ratio, formula)
        ratios[num, remat] = f"{ratio:.4f} vs {formula:.4f}"
    return f"S={stages}: " + ", ".join(
        f"M={m} remat={r}: {v}" for (m, r), v in ratios.items()
    )


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(name):
    """Runs check ``name``; its wall and CPU seconds go to stderr (the CPU
    time does not depend on what else the machine runs)."""
    start, start_cpu = time.perf_counter(), cpu_seconds()
    try:
        return _run(name)
    finally:
        wall, used = time.perf_counter() - start, cpu_seconds() - start_cpu
        print(f"{name}: {wall:.1f}s wall {used:.1f}s cpu", file=sys.stderr)


def _run(name):
    if name.startswith("exact_"):
        return check_exact(name.removeprefix("exact_"))
    if name.startswith("auto_mesh_"):
        return check_exact(name.removeprefix("auto_mesh_"), AxisType.Auto)
    if name.startswith("1f1b_exact_"):
        return check_one_f_one_b_exact(name.removeprefix("1f1b_exact_"))
    if name.startswith("float64_"):
        return check_float64(name.removeprefix("float64_"))
    if name.startswith("interleaved_"):
        import interleaved_checks  # noqa: PLC0415 (it imports this module)

        return interleaved_checks.run(name.removeprefix("interleaved_"))
    if name.startswith("zero_bubble_"):
        import zero_bubble_checks  # noqa: PLC0415 (it imports this module)

        return zero_bubble_checks.run(name.removeprefix("zero_bubble_"))
    checks = {
        "nan_bubble_fill_R2": lambda: check_nan(float("nan"), stage_fn),
        "nan_on_zero_input_stage": lambda: check_nan(0.0, nan_at_zero_stage),
        "weighted_aux_keys_any_schedule": check_weighted_aux_keys,
        "sum_reduction": check_sum_reduction,
        "bfloat16_stage_params": check_bfloat16,
        "report_stats": check_report_stats,
        "loss_scale_over_stages_and_shards": check_loss_scale,
        "bubble_and_nested_flops": check_flops,
        "memory_per_device": check_memory,
        "plan_pipeline_stage4_data2": check_plan_pipeline,
        "plan_pipeline_device_order": check_plan_pipeline_device_order,
        "transformer_loss_curve": check_transformer,
        "1f1b_float64": check_one_f_one_b_float64,
        "1f1b_nan_bubbles_skipped_and_masked": check_one_f_one_b_nan,
        "1f1b_weighted_aux_keys": lambda: check_weighted_aux_keys("1f1b"),
        "1f1b_sum_reduction": lambda: check_sum_reduction("1f1b"),
        "1f1b_bfloat16_stage_params": lambda: check_bfloat16("1f1b"),
        "1f1b_loss_scale": lambda: check_loss_scale("stage4_data2_M7", "1f1b"),
        "1f1b_report_stats": lambda: check_report_stats("stage4_data2_M7", "1f1b"),
        "1f1b_memory_flat_in_M": check_one_f_one_b_memory,
        "1f1b_flops": check_one_f_one_b_flops,
    }
    return checks[name]()


def main():
    report(CHECKS, run, 8)


def check_device_order(name, schedule, axis_type=AxisType.Explicit):
    """``stage_order="device"``: the stages stacked as the devices hold them
    (``pipeline_stage_order``), float64: the gradients are the sequential
    model's, in the same order (the reference's permuted); no parameter is
    relaid out: no all-to-all, and no collective-permute outside the loop
    (the model order's relayout has both for ``R > 1``)."""
    jax.config.update("jax_enable_x64", True)
    try:
        case = make_case(name, np.float64, axis_type=axis_type, schedule=schedule)
        order = jaxaccum.pipeline_stage_order(case.num_stages, case.repeats, schedule)
        params, batch = case.placed
        held = jax.tree.map(  # on the host, then placed as the stages were
            lambda p: jax.device_put(np.asarray(p)[order], p.sharding), params[1]
        )
        step = pipelined(case, stage_order="device")
        compiled, out = compiled_run(step, (params[0], held, params[2]), batch)
        loss, grads = reference(case)
        stages = jax.tree.map(lambda g: g[order], grads[1])
        expected = (loss, (grads[0], stages, grads[2]))
        rtol = tolerance(2.0**-53, layers=case.layers, batch=max(case.rows, BATCH))
        chex.assert_trees_all_close(out, expected, rtol=rtol, atol=rtol)
        error = max_error(out, expected)
    finally:
        jax.config.update("jax_enable_x64", False)
    found = find_collectives(compiled)
    moved = [
        c
        for c in found
        if c.op == "all-to-all" or (c.op == "collective-permute" and not c.in_loop)
    ]
    assert not moved, moved
    in_loop = sorted({c.op for c in found if c.in_loop})
    return f"max error {error:.2e} (tol {rtol:.1e}); in the loop: {in_loop}, none moved"


def check_plan_pipeline_device_order():
    """plan_pipeline(stage_order="device") compiles each schedule's
    device-order program: at stage=4 x data=2, R = 2, M = 8, v-half's and
    interleaved 1F1B's footprints below model order's (the relaid copy of
    the stages not held; the parameters' shapes are the same in both
    orders, so one stack plans both)."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    params = jax.device_put(
        make_params(8), tuple(NamedSharding(mesh, spec) for spec in param_specs(None))
    )
    footprints = {}
    with compiles_to_read():
        for schedule, order in itertools.product(("v-half", "1f1b"), STAGE_ORDERS):
            plan = jaxaccum.plan_pipeline(
                stage_fn,
                loss_fn,
                params,
                make_batch(ROWS * 2),
                mesh=mesh,
                embed_fn=embed_fn,
                data_axis="data",
                repeats=2,
                schedule=schedule,
                stage_order=order,
                memory_budget=2**40,
                candidates=[8],
                remat=False,
            )
            footprints[schedule, order] = plan.footprint_bytes
    for schedule in ("v-half", "1f1b"):
        held, relaid = footprints[schedule, "device"], footprints[schedule, "model"]
        assert held < relaid, footprints
    return ", ".join(f"{k}: {v} B" for k, v in footprints.items())


if __name__ == "__main__":
    sys.exit(main())
