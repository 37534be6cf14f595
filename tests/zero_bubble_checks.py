"""schedule="zero-bubble" on 8 CPU devices: pipeline_checks.py's checks run
for it (in that script's process, on its cases and tolerances), a drawn
property check against the sequential model and 1F1B, and its compiled
measurements (temporaries against 1F1B's, FLOPs of each slot).
"""

import dataclasses
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from pipeline_checks import (
    BATCH,
    UNIT_ROUNDOFF,
    WIDE,
    WIDE_ROWS,
    check_bfloat16,
    check_drawn_against,
    check_exact,
    check_float64,
    check_loss_scale,
    check_nan_cases,
    check_report_stats,
    check_sum_reduction,
    check_weighted_aux_keys,
    compile_to_read,
    normal,
    program_flops,
    stage_fn,
    tolerance,
    wide_case,
    wide_temps,
)

from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._zero_bubble import ZeroBubble

SCHEDULE = "zero-bubble"


def check_exact_layout(name: str) -> str:
    """A layout of ZERO_BUBBLE as check_exact: equal to the sequential model,
    gradients sharded as the parameters, in the loop only the two
    collective-permutes, once a tick to the last F or B (the W-only ticks
    after it are a loop of their own with no collectives)."""
    return check_exact(name, schedule=SCHEDULE)


def check_zero_bubble_float64():
    return "; ".join(
        f"{name}: {check_float64(name, SCHEDULE)}"
        for name in (
            "stage8_M7",
            "stage4_data2_M1",
            "stage4_data2_M16",
            "stage2_fsdp4_M3",
        )
    )


def check_zero_bubble_nan():
    """check_nan on zero-bubble: skipped B and W slots compute nothing;
    masked ones compute on the fill or on a stale ring slot and are
    selected away."""
    return check_nan_cases("stage4_data2_M7", SCHEDULE)


DRAWN = ("stage8_M7", "stage4_data2_M4", "stage4_data2_M16", "stage2_fsdp4_M3")


def check_drawn_options():
    """Drawn (case, remat, unroll): zero-bubble equals the sequential model
    (the case's bound) and 1F1B on the same options (twice it: each is that
    close to the model)."""
    return check_drawn_against(
        SCHEDULE,
        "1f1b",
        DRAWN,
        5,
        lambda case: tolerance(UNIT_ROUNDOFF, batch=max(case.rows, BATCH)),
    )


def slot_flops(remat: bool) -> dict[str, float]:
    """FLOPs of each slot's stage work as the schedules build it (the
    wide model's stage, one micro-batch of WIDE_ROWS rows), compiled alone:
    the forward (its residuals saved), 1F1B's backward (the pullback whole),
    zero-bubble's B and W (the backward split at its jaxpr), and the
    pullback with its input's cotangent dropped (what W would cost
    without the split: the same for one layer, 2 L - 1 layers' for L)."""
    rng = np.random.default_rng(0)
    params = {"w": normal(rng, (WIDE, WIDE)), "b": jnp.zeros(WIDE)}
    x = normal(rng, (WIDE_ROWS, WIDE))
    body = jax.checkpoint(stage_fn) if remat else stage_fn

    def stage(given, x):
        return body(given[0], x)

    programs, _, _ = _slot_programs()(stage, (params, None), x)

    def flops(fun, *args):
        return compile_to_read(jax.jit(fun).lower(*args)).cost_analysis()["flops"]

    return {name: flops(fun, *args) for name, (fun, args) in programs.items()}


def _slot_programs():
    """benchmarks/pipeline_slots.py's slot programs: the benchmarks' FLOPs
    and times are measured on the same ones."""
    benchmarks = str(pathlib.Path(__file__).parents[1] / "benchmarks")
    if benchmarks not in sys.path:  # after tests/: nothing of theirs shadowed
        sys.path.append(benchmarks)
    from pipeline_slots import slot_programs  # noqa: PLC0415

    return slot_programs


def check_memory_and_slots():
    """At S = 4: temporaries per device (memory_analysis, in activations)
    flat in M (8 S within 1.05x of 2 S); without remat at most 1F1B's
    (ZB-H1's memory: a ring of S residual slots where 1F1B keeps K = 2 S -
    1, fewer than S stored boundaries, the two inboxes); with remat 1F1B's
    ring of K slots, the stored boundaries' (K; one activation a slot for
    this one-layer stage, no inboxes: remat's tables use what arrives at
    once) and at most two activations of the slots' own; each slot's
    FLOPs against the forward's (B and W each about a forward without
    remat, their sum 1F1B's backward; with remat B recomputes the forward
    and W reads what it recomputed); the whole program's FLOPs against
    1F1B's: XLA counts every slot's conditional, skipped or not, so each
    loop tick counts an F, a B and a W (3 against 1F1B's F and backward's
    3) and each tick after the loop a W."""
    stages, temps = 4, {}
    for kind, remat, num in itertools.product(
        (SCHEDULE, "1f1b"), (False, True), (2 * stages, 8 * stages)
    ):
        temps[kind, remat, num] = wide_temps(kind, remat, stages, num)
    for remat in (False, True):
        small, big = (temps[SCHEDULE, remat, n] for n in (2 * stages, 8 * stages))
        assert big <= 1.05 * small, temps
        for num in (2 * stages, 8 * stages):
            grid = ZeroBubble.for_window(stages, num, 1, remat).grid()
            extra = temps[SCHEDULE, remat, num] - temps["1f1b", remat, num]
            if not remat:
                assert (grid.ring_size, grid.stored_size) == (stages, stages - 1)
                assert extra <= 0, temps
                continue
            assert grid.stored_size <= min(2 * stages - 1, num)
            held = grid.stored_size
            assert held <= extra <= held + 2.05, (held, temps)
    slots = {remat: slot_flops(remat) for remat in (False, True)}
    plain = slots[False]
    for part in ("input_b", "weight_w"):
        assert 0.9 <= plain[part] / plain["forward"] <= 1.2, plain
    whole = plain["input_b"] + plain["weight_w"]
    assert abs(whole / plain["backward_1f1b"] - 1) <= 0.1, plain
    num = 8
    case = wide_case(stages, num)
    flops = {
        kind: program_flops(dataclasses.replace(case, schedule=kind))
        for kind in (SCHEDULE, "1f1b")
    }
    schedule = ZeroBubble(stages, num)
    appended = schedule.num_ticks - schedule.loop_ticks
    one_ticks = OneFOneB(stages, num).num_ticks
    formula = (3 * schedule.loop_ticks + appended) / (3 * one_ticks)
    ratio = flops[SCHEDULE] / flops["1f1b"]
    assert abs(ratio / formula - 1) <= 0.05, (ratio, formula)
    temp_text = ", ".join(
        f"{k} remat={r} M={n}: {v:.1f}" for (k, r, n), v in temps.items()
    )
    slot_text = "; ".join(
        f"remat={remat}: "
        + ", ".join(
            f"{part} {value / costs['forward']:.3f}" for part, value in costs.items()
        )
        for remat, costs in slots.items()
    )
    return (
        f"temporaries {temp_text}; slots / forward {slot_text}; program FLOPs "
        f"/ 1F1B's at M={num}: {ratio:.4f} vs {formula:.4f}"
    )


CHECKS = {
    "float64": check_zero_bubble_float64,
    "nan_bubbles_skipped_and_masked": check_zero_bubble_nan,
    "weighted_aux_keys": lambda: check_weighted_aux_keys(SCHEDULE),
    "sum_reduction": lambda: check_sum_reduction(SCHEDULE),
    "bfloat16_stage_params": lambda: check_bfloat16(SCHEDULE),
    "loss_scale": lambda: check_loss_scale("stage4_data2_M7", SCHEDULE),
    "report_stats": lambda: check_report_stats("stage4_data2_M7", SCHEDULE),
    "drawn_options_agree": check_drawn_options,
    "memory_and_slots": check_memory_and_slots,
}


def run(name: str) -> str:
    """Runs check ``zero_bubble_<name>`` (pipeline_checks.run's dispatch)."""
    if name.startswith("exact_"):
        return check_exact_layout(name.removeprefix("exact_"))
    return CHECKS[name]()
