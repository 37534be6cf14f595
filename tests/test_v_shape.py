"""schedule="v-zb" (the V-shaped zero-bubble schedule, repeats=2) and
"v-half" (the same at a lower cap): their tables' invariants here, on this
process's one device; their 8-device checks (exactness against the
sequential model, the loop's collectives) in one subprocess,
``v_shape_checks.py``."""

import json
import pathlib

import chex
import jax
import numpy as np
import pytest
import test_pipeline as tp
from check_scripts import run_script, selected_checks
from v_shape_checks import CHECKS

import jaxaccum
from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._v_tables import (
    B,
    F,
    W,
    device_of,
    half_plan,
    one_f_one_b_ticks,
    op_ticks,
    v_tables,
)

RESULTS = (
    pathlib.Path(__file__).parents[1]
    / "benchmarks"
    / "results"
    / "pipeline_v_shape.json"
)
WINDOWS = [(2, 2), (2, 3), (2, 4), (4, 3), (4, 4), (4, 8), (4, 16), (8, 8), (3, 5)]
CAPS = ["v-zb", "v-half"]


def tables(stages: int, num: int, schedule: str):
    """The schedule's tables: v-zb's at the cap 2 S, v-half's half_plan's."""
    if schedule == "v-half":
        return v_tables(stages, num, *half_plan(stages, num))
    return v_tables(stages, num)


@pytest.mark.parametrize("schedule", CAPS)
@pytest.mark.parametrize(("stages", "num"), WINDOWS)
def test_every_op_once_on_its_device_after_what_it_needs(stages, num, schedule):
    """Each (micro-batch, stage)'s F, B and W run exactly once, on the
    stage's device, each a tick or more after what it reads: F after the
    previous stage's F, B after its F and the next stage's B (the last
    stage's: its loss, in its F's tick), W after its B."""
    t = tables(stages, num, schedule)
    stage = np.where(t.chunk == 1, 2 * stages - 1 - np.arange(stages)[:, None], 0)
    stage = np.where(t.chunk == 0, np.arange(stages)[:, None], stage)
    seen = {}
    for d, tick in zip(*np.nonzero(t.op >= 0), strict=True):
        key = (int(t.op[d, tick]), int(t.micro[d, tick]), int(stage[d, tick]))
        assert key not in seen, key
        assert device_of(key[2], stages) == d, key
        seen[key] = tick
    ops = {
        (op, m, k) for op in (F, B, W) for m in range(num) for k in range(2 * stages)
    }
    assert set(seen) == ops
    at = op_ticks(np.stack([t.op, t.micro, stage]), stages, num)
    assert (at[F, 1:] > at[F, :-1]).all()
    assert (at[B] > at[F]).all() and (at[B, :-1] > at[B, 1:]).all()
    assert (at[W] > at[B]).all()


def _replay(t, d: int) -> None:
    """Device ``d``'s slots replayed: no live slot overwritten, every read
    of the value written for it."""
    ring, stored, inbox, back = {}, {}, {}, {}
    for tick in range(t.op.shape[1]):
        for table, box in (("x_down", inbox), ("x_up", inbox), ("g_down", back)):
            slot = getattr(t, table)[d, tick]
            if slot >= 0:
                assert slot not in box, (table, d, tick)
                box[slot] = tick
        if t.g_up[d, tick] >= 0:
            assert t.g_up[d, tick] not in back
            back[t.g_up[d, tick]] = tick
        op, key = t.op[d, tick], (t.micro[d, tick], t.chunk[d, tick])
        if op == F:
            assert t.ring[d, tick] not in ring
            ring[t.ring[d, tick]] = key
            if not (d == 0 and key[1] == 0):
                assert inbox.pop(t.x_slot[d, tick]) <= tick
        if op == B:
            assert ring[t.ring[d, tick]] == key
            assert back.pop(t.g_slot[d, tick]) <= tick
            assert t.stored[d, tick] not in stored
            stored[t.stored[d, tick]] = key
        if op == W:
            assert ring.pop(t.ring[d, tick]) == key
            assert stored.pop(t.stored[d, tick]) == key
    assert not (ring or stored or inbox or back)
    for slots, size in ((t.ring, t.ring_size), (t.stored, t.stored_size)):
        assert slots.max() < size


@pytest.mark.parametrize("schedule", CAPS)
@pytest.mark.parametrize(("stages", "num"), WINDOWS)
def test_slots_never_overwrite_what_is_held(stages, num, schedule):
    t = tables(stages, num, schedule)
    for d in range(stages):
        _replay(t, d)
    cap = half_plan(stages, num).cap if schedule == "v-half" else 2 * stages
    assert t.ring_size <= cap  # the cap: chunk activations F..W
    assert (t.op[:, t.loop_ticks :] != F).all() and (t.op[:, t.loop_ticks :] != B).all()


def test_window_is_the_benchmarks_model():
    """The tables' window (ticks / 2, in whole stages) and ring are the
    greedy model's of benchmarks/pipeline_v_shape.py at the cap 2 S (its
    committed rows): at S = 4, M = 16, 50 against ZB-H1's 51 and 1F1B's 57."""
    rows = json.loads(RESULTS.read_text())["rows"]
    for name, row in rows.items():
        stages, num = (int(x) for x in name[1:].split("_M"))
        if stages * num > 64:
            continue
        t = v_tables(stages, num)
        named = row["named"]["v_zb"]
        assert t.op.shape[1] / 2 == named["window"], name
        assert t.ring_size / 2 <= named["held"], name
    assert v_tables(4, 16).op.shape[1] == 100


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6, 8])
def test_v_half_within_1f1b_window_at_a_cap_flat_in_m(stages):
    """v-half's window (in chunk ops) is no longer than lockstep 1F1B's on
    the same layers (its modeled window, two chunk ops a stage) at every M
    from 1 to 8 S (at S = 8, every third); its plan is one for all M >= 2,
    its cap no more than v-zb's, and one less would be longer than 1F1B's
    at M = 8 S in either order of ready B's."""
    plans = set()
    for num in range(1, 8 * stages + 1, 3 if stages == 8 else 1):
        one_f_one_b = 2 * OneFOneB(stages, num, 1).modeled_window()
        assert one_f_one_b_ticks(stages, num) == one_f_one_b
        assert tables(stages, num, "v-half").op.shape[1] <= one_f_one_b, num
        if num >= 2:
            plans.add(half_plan(stages, num))
    ((cap, _),) = plans
    assert cap <= 2 * stages
    for up_first in (False, True):
        shorter = v_tables(stages, 8 * stages, cap - 1, up_first).op.shape[1]
        assert cap == 3 or shorter > one_f_one_b_ticks(stages, 8 * stages)


@pytest.fixture(scope="module")
def results(request) -> dict:
    checks = selected_checks(request)
    return run_script("v_shape_checks.py", num_devices=8, timeout=900, checks=checks)


@pytest.mark.parametrize("check", CHECKS)
def test_v_shape_on_8_devices(results, check):
    assert results[check]["ok"], results[check]["detail"]


@pytest.mark.parametrize(
    ("reduction", "with_key", "stats", "by_size", "schedule"),
    [
        ("mean", False, False, False, "v-zb"),
        ("weighted", True, True, True, "v-zb"),
        ("weighted", True, False, False, "v-half"),
    ],
)
def test_one_device_options_against_the_window_reference(
    reduction, with_key, stats, by_size, schedule
):
    """On one device (S = 1: both chunks on it, the V's tip and its loss
    handed to itself): v-zb with keys (folded per model stage), a weighted
    reduction with aux, report_stats and M given as a size equals
    test_pipeline.py's micro-batch by micro-batch reference."""
    params, batch = tp.one_device_case(2)
    key = jax.random.key(3) if with_key else None
    weighted = reduction == "weighted"
    rows = jax.tree.leaves(batch)[0].shape[0]
    split = (
        {"microbatch_size": rows // tp.NUM} if by_size else {"num_microbatches": tp.NUM}
    )
    step = jaxaccum.pipeline_value_and_grad(
        tp.noisy_dense if with_key else tp.dense,
        tp.weighted_mse if weighted else tp.mse,
        **split,
        mesh=tp.MESH,
        embed_fn=tp.noisy_embed if with_key else tp.embed,
        repeats=2,
        reduction=reduction,
        has_aux=weighted,
        report_stats=stats,
        schedule=schedule,
    )
    out = jax.jit(step)(params, batch, key)
    if stats:
        out, window_stats = out
        assert window_stats.microbatch_grad_sq_norm.shape == (tp.NUM,)
        assert bool(window_stats.finite)
    (value, aux), grads = tp.window_reference(params, batch, reduction, key, 2)
    expected = ((value, aux), grads) if weighted else (value, grads)
    chex.assert_trees_all_close(out, expected, rtol=tp.RTOL, atol=tp.RTOL)


@pytest.mark.parametrize("schedule", CAPS)
@pytest.mark.parametrize(("repeats", "remat"), [(1, False), (3, False), (2, True)])
def test_what_v_zb_is_not_built_for_is_refused_with_why(repeats, remat, schedule):
    """repeats other than 2 at construction, remat when the window is
    built, each saying what is not built."""
    params, batch = tp.one_device_case(repeats)
    what = "remat is not built" if remat else "repeats=2 only"
    match = f"schedule='{schedule}' {'with ' if remat else ''}.*{what}"
    with pytest.raises(ValueError, match=match):
        step = jaxaccum.pipeline_value_and_grad(
            tp.dense,
            tp.mse,
            tp.NUM,
            mesh=tp.MESH,
            embed_fn=tp.embed,
            repeats=repeats,
            remat=remat,
            schedule=schedule,
        )
        jax.jit(step)(params, batch)
