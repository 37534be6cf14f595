"""schedule="1f1b" with repeats > 1 (interleaved 1F1B) on 8 CPU devices:
pipeline_checks.py's checks run for it (in that script's process, on its
cases and tolerances), a drawn property check against the sequential model
and GPipe's circular schedule, one against 1F1B on the same model, and its
compiled measurements (temporaries against 1F1B's, FLOPs of a slot).
"""

import dataclasses
import functools
import re

import chex
import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_checks import (
    BATCH,
    INTERLEAVED,
    NAN_CASES,
    ROWS,
    UNIT_ROUNDOFF,
    WIDE,
    WIDE_ROWS,
    Case,
    check_bfloat16,
    check_device_order,
    check_drawn_against,
    check_exact,
    check_float64,
    check_loss_scale,
    check_nan_cases,
    check_report_stats,
    check_sum_reduction,
    check_weighted_aux_keys,
    compile_to_read,
    make_batch,
    make_params,
    max_error,
    pipelined,
    program_flops,
    reference,
    sequential_flops,
    tolerance,
    wide_case,
    wide_temps,
)

from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum._plan._hlo import _program, find_collectives

SCHEDULE = "1f1b"
# Exact on every mesh: M = S, 2S on stage=8; M < S, S, 7, 4S on stage=4 x
# data=2; M = 5 (R = 3), 4S (R = 4) on stage=2 x fsdp=4. stage4_data2_M8_R2
# is float64's.
MATRIX = tuple(name for name, *_ in INTERLEAVED if name != "stage4_data2_M8_R2")


def check_exact_matrix():
    """check_exact over MATRIX: equal to the sequential model, gradients
    sharded as the parameters, in the loop only the two collective-permutes
    (round the ring both ways), once a tick."""
    errors = {}
    for name in MATRIX:
        detail = check_exact(name, schedule=SCHEDULE)
        errors[name] = detail.split(";")[0].removeprefix("max error ")
    return "; ".join(f"{name}: {error}" for name, error in errors.items())


def check_interleaved_float64():
    return "; ".join(
        f"{name}: {check_float64(name, SCHEDULE)}"
        for name in ("stage4_data2_M8_R2", "stage2_fsdp4_M5_R3")
    )


def check_interleaved_nan():
    """check_nan with M = 7 (a padded group): skipped slots compute nothing;
    masked ones compute on the NaN fill or a stale ring slot, selected
    away."""
    return check_nan_cases("stage4_data2_M7_R2", SCHEDULE, NAN_CASES[:2])


DRAWN = ("stage8_M8_R2", "stage4_data2_M4_R2", "stage4_data2_M7_R2")


def check_drawn_options():
    """Drawn (case, remat, unroll): interleaved 1F1B equals the sequential
    model (the case's bound) and GPipe's circular schedule on the same
    options and repeats (twice it)."""
    return check_drawn_against(
        SCHEDULE,
        "gpipe",
        DRAWN,
        3,
        lambda case: tolerance(UNIT_ROUNDOFF, layers=case.layers, batch=BATCH),
    )


def check_against_1f1b():
    """The same 8 layers and batch: interleaved on stage=4 (R = 2), 1F1B on
    stage=8 (R = 1) and the sequential model agree (the bound, twice between
    the two pipelines)."""
    params, batch, num = make_params(8), make_batch(ROWS * 8), 8
    outs = {}
    for stages, repeats in ((4, 2), (8, 1)):
        mesh = jax.make_mesh((stages,), ("stage",), devices=jax.devices()[:stages])
        specs = (P(), P("stage"), P())
        placed = tuple(
            jax.device_put(p, NamedSharding(mesh, spec))
            for p, spec in zip(params, specs, strict=True)
        )
        case = Case(mesh, None, num, repeats, params, batch, (), SCHEDULE)
        step = jax.jit(pipelined(case))
        out = step(placed, jax.device_put(batch, NamedSharding(mesh, P())))
        outs[repeats] = jax.device_get(out)  # two meshes: compared on the host
    rtol = tolerance(UNIT_ROUNDOFF, batch=BATCH)
    expected = jax.device_get(
        reference(Case(None, None, num, 2, params, batch, (), SCHEDULE))
    )
    chex.assert_trees_all_close(outs[2], expected, rtol=rtol, atol=rtol)
    chex.assert_trees_all_close(outs[2], outs[1], rtol=2 * rtol, atol=2 * rtol)
    return f"max error vs 1F1B {max_error(outs[2], outs[1]):.1e}"


@functools.cache
def interleaved_compiled(remat: bool, stages: int, num: int, repeats: int):
    """The wide model of ``S R`` layers under interleaved 1F1B, compiled to
    be read (once a process: the memory and HLO checks share it)."""
    case = dataclasses.replace(wide_case(stages, num, repeats), schedule=SCHEDULE)
    return compile_to_read(jax.jit(pipelined(case, remat=remat)).lower(*case.placed))


def interleaved_temps(remat: bool, stages: int, num: int, repeats: int) -> float:
    """Per-device temporaries of the wide model of ``S R`` layers under
    interleaved 1F1B, in activations."""
    compiled = interleaved_compiled(remat, stages, num, repeats)
    return compiled.memory_analysis().temp_size_in_bytes / (WIDE_ROWS * WIDE * 4)


_SLICE = re.compile(r"%(\S+) = \S+ (dynamic-slice|slice)\(%([^,)]+)")
_SHAPE = re.compile(r"%(\S+) = [a-z0-9]+\[([0-9,]*)\]")
_IN_PLACE = re.compile(r"ROOT %\S+ = \S+ dynamic-update-slice\(%([^,)]+)")


def stack_slices_in_loop(text: str, stacks: set) -> list[str]:
    """The slices in the loop's computations (fused ones included) of an
    array shaped as one of ``stacks`` (a device's stacked stage parameters:
    a slice of one is a copy of a stage's parameters made every tick); a
    fusion's read of the array its root updates in place (the gradient's
    ``(R, ...)`` accumulator, added to at the tick's repeat) is none."""
    bodies, in_loop = _program(text)
    found = []
    for name in in_loop:
        updated = {m.group(1) for m in map(_IN_PLACE.search, bodies[name]) if m}
        shapes = {}
        for line in bodies[name]:
            match = _SHAPE.search(line)
            if match:
                shapes[match.group(1)] = tuple(
                    int(d) for d in match.group(2).split(",") if d
                )
        for line in bodies[name]:
            match = _SLICE.search(line)
            read = match.group(3) if match else None
            if read not in updated and shapes.get(read) in stacks:
                found.append(line.strip()[:160])
    return found


def check_no_parameter_copies():
    """At S = 4, R = 2 (M = 2S, the memory check's program): no slice of the
    device's stacked stage parameters in the loop (a stage slot reads its
    chunk's parameters whole, split once before the loop), and outside it
    the stages are relaid out once: all-to-alls of at most the parameters'
    bytes (device d holds stages 2d, 2d + 1 as they arrive, runs d, 4 + d)."""
    stages, repeats = 4, 2
    compiled = interleaved_compiled(False, stages, 2 * stages, repeats)
    like = wide_case(stages, 2 * stages, repeats).params[1]
    stacks = set()
    for leaf in jax.tree.leaves(like):
        rest = tuple(leaf.shape[1:])
        stacks |= {(repeats, *rest), (repeats, 1, *rest)}
    text = compiled.as_text()
    found = stack_slices_in_loop(text, stacks)
    assert not found, found
    moved = [c for c in find_collectives(compiled) if c.op == "all-to-all"]
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(like))
    assert sum(c.bytes for c in moved) <= param_bytes, (moved, param_bytes)
    return (
        f"no slice of {sorted(stacks)} in the loop; all-to-all "
        f"{sum(c.bytes for c in moved)} B outside (stages {param_bytes} B)"
    )


def check_device_order_reads_chunks_statically():
    """At S = 4, R = 2 with the stages in device order (``stage_order=
    "device"``: nothing relaid out, no all-to-all): the loop reads the
    device's stack only by static slices (each op's chunk at its index, in
    its branch; XLA:CPU copies that one chunk in the op), never a dynamic
    slice at the tick's repeat, which would copy the stage every tick."""
    stages, repeats = 4, 2
    case = dataclasses.replace(
        wide_case(stages, 2 * stages, repeats), schedule=SCHEDULE
    )  # the shapes are the order's: compiled to be read, never run
    step = pipelined(case, stage_order="device")
    compiled = compile_to_read(jax.jit(step).lower(*case.placed))
    stacks = set()
    for leaf in jax.tree.leaves(case.params[1]):
        rest = tuple(leaf.shape[1:])
        stacks |= {(repeats, *rest), (repeats, 1, *rest)}
    found = stack_slices_in_loop(compiled.as_text(), stacks)
    dynamic = [line for line in found if " dynamic-slice(" in line]
    assert found and not dynamic, found
    moved = [c for c in find_collectives(compiled) if c.op == "all-to-all"]
    assert not moved, moved
    return f"{len(found)} static slices of the stack in the loop, none dynamic"


def slot_flops(case: Case, ticks: int) -> float:
    """A device's FLOPs per tick (the scan unrolled) over the sequential
    model's per micro-batch: the share of the model one tick's forward and
    backward slots run (XLA counts a skipped slot's conditional whole)."""
    whole = program_flops(case) / case.num_stages / ticks
    return whole / (sequential_flops(case) / case.num_microbatches)


def check_memory_and_flops():
    """At S = 4, R = 2 (8 layers, 1/2 of a device's each): temporaries per
    device (memory_analysis, in activations) flat in M (8 S within 1.25x of
    2 S) and within 2.5x of 1F1B's (S = 4, a layer a device) at the same M,
    with and without remat: the ring's (R + 1) S - 1 = 11 slots against
    1F1B's 2 S - 1 = 7, a layer each; a tick's forward and backward slot
    are 1/(S R) of the model per micro-batch, 1/R of 1F1B's 1/S (within
    5%)."""
    stages, repeats, temps = 4, 2, {}
    for remat in (False, True):
        for num in (2 * stages, 8 * stages):
            mine = interleaved_temps(remat, stages, num, repeats)
            one = wide_temps(SCHEDULE, remat, stages, num)
            temps[remat, num] = (mine, one)
            assert mine <= 2.5 * one, temps
        small, big = (temps[remat, n][0] for n in (2 * stages, 8 * stages))
        assert big <= 1.25 * small, temps
    num = 8
    mine = wide_case(stages, num, repeats)
    mine = dataclasses.replace(mine, schedule=SCHEDULE)
    one = dataclasses.replace(wide_case(stages, num), schedule=SCHEDULE)
    shares = {
        "interleaved": slot_flops(mine, Interleaved(stages, num, repeats).num_ticks),
        "1f1b": slot_flops(one, num + 2 * (stages - 1)),
    }
    ratio = shares["interleaved"] / shares["1f1b"]
    assert abs(ratio * repeats - 1) <= 0.05, shares
    temp_text = ", ".join(
        f"remat={r} M={n}: {a:.1f} vs 1F1B {b:.1f} ({a / b:.2f}x)"
        for (r, n), (a, b) in temps.items()
    )
    return (
        f"temporaries {temp_text}; a tick's slots / the model per micro-batch "
        f"at M={num}: interleaved {shares['interleaved']:.4f}, 1F1B "
        f"{shares['1f1b']:.4f}, ratio {ratio:.4f} (1/R = {1 / repeats})"
    )


CHECKS = {
    "exact_matrix": check_exact_matrix,
    "float64": check_interleaved_float64,
    "nan_bubbles_skipped_and_masked": check_interleaved_nan,
    "weighted_aux_keys": lambda: check_weighted_aux_keys(SCHEDULE, interleaved=True),
    "sum_reduction": lambda: check_sum_reduction(SCHEDULE, "stage4_data2_M3_R2"),
    "bfloat16_stage_params": lambda: check_bfloat16(SCHEDULE, "stage4_data2_M7_R2"),
    "loss_scale": lambda: check_loss_scale("stage4_data2_M7_R2", SCHEDULE),
    "report_stats": lambda: check_report_stats("stage4_data2_M7_R2", SCHEDULE),
    "drawn_options_agree": check_drawn_options,
    "against_1f1b": check_against_1f1b,
    "memory_and_flops": check_memory_and_flops,
    "no_parameter_copies": check_no_parameter_copies,
    "device_order_reads_chunks_statically": check_device_order_reads_chunks_statically,
    "device_order_fsdp_R3": lambda: check_device_order("stage2_fsdp4_M5_R3", SCHEDULE),
    "device_order_circular_gpipe_auto_mesh": lambda: check_device_order(
        "stage4_data2_M8_R2", "gpipe", AxisType.Auto
    ),
}


def run(name: str) -> str:
    """Runs check ``interleaved_<name>`` (pipeline_checks.run's dispatch)."""
    return CHECKS[name]()
