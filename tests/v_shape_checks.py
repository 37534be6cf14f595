"""schedule="v-zb" and "v-half" (repeats=2) on 8 CPU devices, run as a script by
test_v_shape.py (the device count is fixed when JAX starts): float64
exactness against the sequential model on stage=2 x data=4 and stage=4 x
data=2 at M = S, 2 S and 3, on stage=8 (16 model stages) and on stage=2 x
fsdp=4 (FSDP stage parameters, gathered after the V's mirror); the
compiled loop's collectives; NaN bubbles; weighted reduction, aux and keys;
the loss scale; report_stats; temporaries flat in M. v-half (the same
program at a lower cap) on the cases where its tables differ from v-zb's
(S >= 3): float64, the loop's collectives, NaN bubbles, temporaries flat in
M and below v-zb's."""

import dataclasses
import itertools
import sys
from typing import Any

import chex
import jax
from check_scripts import report
from jax.sharding import AxisType
from pipeline_checks import (
    BATCH,
    EXACT_BY_NAME,
    UNIT_ROUNDOFF,
    WIDE,
    WIDE_ROWS,
    Case,
    activation_bytes,
    check_device_order,
    check_drawn_against,
    check_float64,
    check_loss_scale,
    check_nan_cases,
    check_report_stats,
    check_shardings,
    check_weighted_aux_keys,
    compiled_run,
    make_case,
    max_error,
    pipelined,
    reference,
    temp_bytes,
    tolerance,
    wide_case,
)

from jaxaccum._pipeline._schedules import schedule_type
from jaxaccum._plan._hlo import find_collectives

SCHEDULE = "v-zb"
# (name, mesh shape, mesh axes, data axis, M, R): pipeline_checks' cases.
V_SHAPE = (
    ("stage2_data4_M2_R2", (2, 4), ("stage", "data"), "data", 2, 2),
    ("stage2_data4_M4_R2", (2, 4), ("stage", "data"), "data", 4, 2),
    ("stage2_data4_M3_R2", (2, 4), ("stage", "data"), "data", 3, 2),
    ("stage4_data2_M4_R2", (4, 2), ("stage", "data"), "data", 4, 2),
    ("stage4_data2_M8_R2", (4, 2), ("stage", "data"), "data", 8, 2),
    ("stage4_data2_M3_R2", (4, 2), ("stage", "data"), "data", 3, 2),
    ("stage8_M8_R2", (8,), ("stage",), None, 8, 2),
    ("stage2_fsdp4_M4_R2", (2, 4), ("stage", "fsdp"), "fsdp", 4, 2),
)
EXACT_BY_NAME.update({case[0]: case for case in V_SHAPE})

CHECKS = [
    *(f"float64_{case[0]}" for case in V_SHAPE),
    "collectives_stage4_data2_M8_R2",
    "collectives_stage2_data4_M3_R2",
    "collectives_stage8_M8_R2",
    "collectives_stage2_fsdp4_M4_R2",
    "nan_bubbles_skipped_and_masked",
    "weighted_aux_keys",
    "loss_scale",
    "report_stats",
    "memory_flat_in_M",
    "auto_mesh_stage4_data2_M4_R2",
    "v_half_float64_stage4_data2_M8_R2",
    "v_half_float64_stage8_M8_R2",
    "v_half_collectives_stage4_data2_M3_R2",
    "v_half_nan_bubbles_skipped_and_masked",
    "v_half_memory_flat_in_M",
    "v_half_drawn_options_agree",
    "device_order_stage2_fsdp4_M4_R2",
    "v_half_device_order_stage4_data2_M8_R2",
]


def permutes(case: Case) -> tuple[Any, list]:
    """The case's compiled step, its output, and its collectives."""
    compiled, out = compiled_run(pipelined(case), *case.placed)
    return out, find_collectives(compiled)


def check_collectives(name: str, schedule: str = SCHEDULE) -> str:
    """Float32, equal to the sequential model; in the loop exactly the four
    collective-permutes (activations down and up, cotangents up and down),
    one activation each, once a tick to the last F or B (the W-only ticks
    after it are a loop without collectives); outside, interleaved 1F1B's
    relayout of the same stages plus the V's mirror (one permute a stage
    leaf in, one for its gradient out)."""
    case = make_case(name, schedule=schedule)
    out, found = permutes(case)
    rtol = tolerance(UNIT_ROUNDOFF, layers=case.layers, batch=max(case.rows, BATCH))
    chex.assert_trees_all_close(out, reference(case), rtol=rtol, atol=rtol)
    in_loop = [c for c in found if c.in_loop]
    assert [c.op for c in in_loop] == ["collective-permute"] * 4, in_loop
    cls = schedule_type(schedule, 2)
    ticks = cls(case.num_stages, case.num_microbatches, 2).loop_ticks
    assert all(c.bytes == activation_bytes(case) for c in in_loop), in_loop
    assert all(c.runs == ticks for c in in_loop), (in_loop, ticks)
    _, interleaved = permutes(make_case(name, schedule="1f1b"))
    leaves = len(jax.tree.leaves(case.params[1]))

    def outside(found: list, op: str) -> int:
        return sum(1 for c in found if c.op == op and not c.in_loop)

    mirror = outside(found, "collective-permute")
    base = outside(interleaved, "collective-permute")
    assert mirror == base + 2 * leaves, (found, interleaved)
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert outside(found, op) == outside(interleaved, op), op
    return (
        f"loop: 4 collective-permutes x {activation_bytes(case)} B x {ticks} "
        f"ticks; outside: {mirror} collective-permutes (interleaved 1F1B's "
        f"{base} + 2 x {leaves} stage leaves), the rest as interleaved's"
    )


def check_v_nan(schedule: str = SCHEDULE) -> str:
    """check_nan on v-zb or v-half: skipped F, B and W slots compute nothing; masked
    ones compute on the fill or on a stale ring slot and are selected
    away."""
    return check_nan_cases("stage4_data2_M3_R2", schedule)


def check_memory() -> str:
    """Temporaries per device (memory_analysis, in activations) of the wide
    model's 2 S = 8 chunks on S = 4 devices: v-zb's flat in M (M = 4 S
    within 2% of 2 S: its ring is at most 2 S chunk slots whatever M), and
    against interleaved 1F1B's on the same stacked stages (reported)."""
    stages, temps = 4, {}
    for kind, num in itertools.product((SCHEDULE, "1f1b"), (2 * stages, 4 * stages)):
        case = dataclasses.replace(wide_case(stages, num, 2), schedule=kind)
        temps[kind, num] = temp_bytes(case) / (WIDE_ROWS * WIDE * 4)
    small, big = temps[SCHEDULE, 2 * stages], temps[SCHEDULE, 4 * stages]
    assert big <= 1.02 * small, temps
    return ", ".join(
        f"{'interleaved 1f1b' if k == '1f1b' else k} M={n}: {v:.1f}"
        for (k, n), v in temps.items()
    )


def check_half_memory() -> str:
    """v-half's temporaries on check_memory's model: flat in M (M = 4 S
    within 2% of 2 S: its cap, 5 chunk activations at S = 4, is the same
    for both) and below v-zb's at M = 4 S by at least one of the ring
    slots (of v-zb's 8) it does not keep, each a chunk's residuals: at
    least its input and its tanh's output, 2 activations."""
    stages, temps = 4, {}
    runs = (("v-half", 2 * stages), ("v-half", 4 * stages), (SCHEDULE, 4 * stages))
    for kind, num in runs:
        case = dataclasses.replace(wide_case(stages, num, 2), schedule=kind)
        temps[kind, num] = temp_bytes(case) / (WIDE_ROWS * WIDE * 4)
    assert temps["v-half", 4 * stages] <= 1.02 * temps["v-half", 2 * stages], temps
    assert temps["v-half", 4 * stages] <= temps[SCHEDULE, 4 * stages] - 2, temps
    return ", ".join(f"{k} M={n}: {v:.1f}" for (k, n), v in temps.items())


def check_half_drawn() -> str:
    """Drawn (case, unroll; no remat: not built): v-half equals the
    sequential model (the case's bound) and interleaved 1F1B on the same
    stacked stages and options (twice it)."""
    return check_drawn_against(
        "v-half",
        "1f1b",
        ("stage4_data2_M8_R2", "stage4_data2_M3_R2", "stage8_M8_R2"),
        4,
        lambda case: tolerance(
            UNIT_ROUNDOFF, layers=case.layers, batch=max(case.rows, BATCH)
        ),
        remats=(False,),
    )


def check_auto_mesh(name: str) -> str:
    """On an Auto mesh (the step cannot see the parameters' shardings):
    equal to the sequential model, the gradients' stages over the stage
    axis."""
    case = make_case(name, axis_type=AxisType.Auto, schedule=SCHEDULE)
    out = jax.jit(pipelined(case))(*case.placed)
    rtol = tolerance(UNIT_ROUNDOFF, layers=case.layers, batch=max(case.rows, BATCH))
    chex.assert_trees_all_close(out, reference(case), rtol=rtol, atol=rtol)
    check_shardings(out[1], case.placed[0])
    return f"max error {max_error(out, reference(case)):.2e} (tol {rtol:.1e})"


def run(name: str) -> str:
    """Runs check ``name`` (one of CHECKS)."""
    checks = {
        "nan_bubbles_skipped_and_masked": check_v_nan,
        "weighted_aux_keys": lambda: check_weighted_aux_keys(SCHEDULE, True),
        "loss_scale": lambda: check_loss_scale("stage4_data2_M8_R2", SCHEDULE),
        "report_stats": lambda: check_report_stats("stage4_data2_M8_R2", SCHEDULE),
        "memory_flat_in_M": check_memory,
        "v_half_nan_bubbles_skipped_and_masked": lambda: check_v_nan("v-half"),
        "v_half_memory_flat_in_M": check_half_memory,
        "v_half_drawn_options_agree": check_half_drawn,
    }
    if name in checks:
        return checks[name]()
    if name.startswith("v_half_device_order_"):
        return check_device_order(name.removeprefix("v_half_device_order_"), "v-half")
    if name.startswith("device_order_"):
        return check_device_order(name.removeprefix("device_order_"), SCHEDULE)
    if name.startswith("v_half_float64_"):
        return check_float64(name.removeprefix("v_half_float64_"), "v-half")
    if name.startswith("v_half_collectives_"):
        return check_collectives(name.removeprefix("v_half_collectives_"), "v-half")
    if name.startswith("float64_"):
        return check_float64(name.removeprefix("float64_"), SCHEDULE)
    if name.startswith("auto_mesh_"):
        return check_auto_mesh(name.removeprefix("auto_mesh_"))
    if name.startswith("collectives_"):
        return check_collectives(name.removeprefix("collectives_"))
    raise KeyError(name)


if __name__ == "__main__":
    print(jax.__version__, file=sys.stderr)
    sys.exit(report(CHECKS, run, 8))
