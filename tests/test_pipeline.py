"""Pipeline parallelism: the window's micro-batches are the pipeline's.

The 8-device checks (exactness on stage=8, stage=4 x data=2 and stage=2 x
fsdp=4 meshes against the sequential model, float32 and float64; NaN in
bubbles; reductions, aux and keys; remat; bfloat16; WindowStats; the
compiled program's collectives, FLOPs against the bubble formula and memory
per device; a small transformer's loss curve) run in ONE subprocess,
``pipeline_checks.py`` (the device count is fixed when JAX starts); their
tolerances are derived there. Here, on this process's one CPU device: the
schedule's properties, the options against the sequential model on a mesh of
one stage, and the errors bad input gets.
"""

import contextlib
import functools
import inspect
import itertools
import json
import pathlib
import unittest.mock
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_loss_scale as loss_scale_tests
from check_scripts import run_script, selected_checks
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from pipeline_checks import (
    CHECKS,
    FEATURES,
    RTOL,
    compiles_to_read,
    make_batch,
    make_params,
    sequential,
    tolerance,
)
from pipeline_checks import embed_fn as embed
from pipeline_checks import loss_fn as mse
from pipeline_checks import stage_fn as dense

import jaxaccum
from jaxaccum import pipeline_value_and_grad
from jaxaccum._pipeline._1f1b import OneFOneB
from jaxaccum._pipeline._1f1b_tick import backward, forward
from jaxaccum._pipeline._calls import takes_key
from jaxaccum._pipeline._gpipe import GPipe
from jaxaccum._pipeline._interleaved import Interleaved
from jaxaccum._pipeline._schedules import (
    SCHEDULES,
    builds,
    schedule_on,
    schedule_type,
)
from jaxaccum._pipeline._spec import PipelineLayout, PipelineWindow
from jaxaccum._pipeline._step import make_pipeline
from jaxaccum._pipeline._v_shape import VShape
from jaxaccum._pipeline._zero_bubble import ZeroBubble
from jaxaccum._pipeline._zero_bubble_split import (
    input_part,
    split_backward,
    weight_part,
)

ZERO_BUBBLE_RESULTS = (
    pathlib.Path(__file__).parents[1]
    / "benchmarks"
    / "results"
    / "pipeline_zero_bubble.json"
)


@pytest.fixture(scope="module")
def results(request) -> dict:
    checks = selected_checks(request)
    return run_script("pipeline_checks.py", num_devices=8, timeout=600, checks=checks)


@pytest.mark.parametrize("check", CHECKS)
def test_pipeline_on_8_devices(results, check):
    assert results[check]["ok"], results[check]["detail"]


# The schedule.


@st.composite
def schedules(draw) -> GPipe:
    stages = draw(st.integers(1, 6))
    repeats = draw(st.integers(1, 3))
    low = stages if repeats > 1 else 1  # a circular schedule needs M >= S
    return GPipe(stages, draw(st.integers(low, 9)), repeats)


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_every_stage_of_every_microbatch_once_and_in_order(schedule):
    """Over the window's ticks each device runs each (micro-batch, repeat)
    once; micro-batch k meets model stage l + 1 after stage l, on the next
    device (after the recirculation delay, back on the first device); it
    enters only on the first device's first repeat and leaves only on the
    last device's last repeat."""
    num, stages = schedule.num_microbatches, schedule.num_stages
    layers = stages * schedule.repeats
    when: dict[tuple[int, int], tuple[int, int]] = {}
    entered, left = [], []
    for tick, device in itertools.product(range(schedule.num_ticks), range(stages)):
        at = schedule.at(jnp.int32(tick), jnp.int32(device))
        if not bool(at.valid):
            continue
        key = (int(at.microbatch), int(at.layer))
        assert key not in when, (key, tick, device)
        when[key] = (tick, device)
        entered += [int(at.microbatch)] if bool(at.enters) else []
        left += [int(at.microbatch)] if bool(at.exits) else []
    assert len(when) == num * layers
    for micro, layer in itertools.product(range(num), range(layers - 1)):
        (tick, device), (later, next_device) = (
            when[micro, layer],
            when[micro, layer + 1],
        )
        assert next_device == (device + 1) % stages
        gap = 1 if device < stages - 1 else num - stages + 1
        assert later - tick == gap, (micro, layer, tick, later)
    assert entered == left == list(range(num))
    busy = num * schedule.repeats / schedule.num_ticks
    assert busy == pytest.approx(1 - schedule.bubble_fraction)


# Options on one device: a mesh of one stage (S = 1), R = 1 or 2.


MESH = jax.make_mesh((1,), ("stage",))
NUM = 4


def one_device_case(repeats):
    return make_params(repeats), make_batch(4 * NUM)


def noisy_dense(params, x, key):
    return dense(params, x, key)


def noisy_embed(params, micro_batch, key):
    return embed(params, micro_batch, key)


def weighted_mse(params, x, micro_batch):
    rows = jnp.sum((x @ params["w"] - micro_batch["y"]) ** 2, -1)
    weight = micro_batch["weight"]
    return (jnp.sum(weight * rows), jnp.sum(weight)), {"worst": jnp.max(rows)}


def window_reference(params, batch, reduction, key=None, layers=1):
    """Micro-batch by micro-batch, as the documentation says the window is:
    strided micro-batches, keys split per micro-batch and folded per layer."""
    keys = None if key is None else jax.random.split(key, NUM)

    def micro(params, k):
        embed_params, stages, head = params
        piece = jax.tree.map(lambda leaf: leaf[k::NUM], batch)
        fold = (
            (lambda i: None)
            if keys is None
            else functools.partial(jax.random.fold_in, keys[k])
        )
        x = embed(embed_params, piece, fold(layers))
        for layer in range(layers):
            x = dense(jax.tree.map(lambda p, i=layer: p[i], stages), x, fold(layer))
        if reduction == "weighted":
            (total, weight), aux = weighted_mse(head, x, piece)
            return total, (weight, aux)
        return mse(head, x, piece), (jnp.float32(1), {})

    sums = [jax.value_and_grad(micro, has_aux=True)(params, k) for k in range(NUM)]
    total = sum(value for (value, _), _ in sums)
    weight = sum(w for (_, (w, _)), _ in sums) if reduction == "weighted" else NUM
    grads = jax.tree.map(lambda *g: sum(g) / weight, *(g for _, g in sums))
    aux = jax.tree.map(lambda *a: sum(a) / NUM, *(a for (_, (_, a)), _ in sums))
    return (total / weight, aux), grads


@settings(max_examples=8, deadline=None)
@given(
    repeats=st.sampled_from([1, 2]),
    reduction=st.sampled_from(["mean", "weighted"]),
    with_key=st.booleans(),
    remat=st.sampled_from([False, True, jax.checkpoint_policies.dots_saveable]),
    stats=st.booleans(),
    by_size=st.booleans(),
    schedule=st.sampled_from(["gpipe", "1f1b", "zero-bubble", "v-zb", "v-half"]),
    stage_order=st.sampled_from(["model", "device"]),
)
def test_options_against_the_window_reference(
    repeats, reduction, with_key, remat, stats, by_size, schedule, stage_order
):
    """Every combination of repeats, reduction (with aux), keys, remat,
    report_stats, M given as a count or a size, the schedule (1F1B, at
    R = 2 interleaved; zero-bubble at R = 1; the V's at R = 2 without remat)
    and the stacked stages' order equals the micro-batch by micro-batch
    reference (RTOL of pipeline_checks.py: the same sums in another order).
    On one device the two orders are one; the 8-device scripts permute
    (check_device_order)."""
    assume(schedule != "zero-bubble" or repeats == 1)
    assume(not schedule.startswith("v-") or (repeats == 2 and not remat))
    params, batch = one_device_case(repeats)
    order = jaxaccum.pipeline_stage_order(1, repeats, schedule)
    assert order.tolist() == list(range(repeats))
    key = jax.random.key(3) if with_key else None
    weighted = reduction == "weighted"
    rows = jax.tree.leaves(batch)[0].shape[0]
    split = {"microbatch_size": rows // NUM} if by_size else {"num_microbatches": NUM}
    step = pipeline_value_and_grad(
        noisy_dense if with_key else dense,
        weighted_mse if weighted else mse,
        **split,
        mesh=MESH,
        embed_fn=noisy_embed if with_key else embed,
        repeats=repeats,
        reduction=reduction,
        has_aux=weighted,
        remat=remat,
        report_stats=stats,
        schedule=schedule,
        stage_order=stage_order,
    )
    out = jax.jit(step)(params, batch, key)
    if stats:
        out, window_stats = out
        assert window_stats.microbatch_grad_sq_norm.shape == (NUM,)
        assert bool(window_stats.finite)
    (value, aux), grads = window_reference(params, batch, reduction, key, repeats)
    expected = ((value, aux), grads) if weighted else (value, grads)
    chex.assert_trees_all_close(out, expected, rtol=RTOL, atol=RTOL)


def test_mean_equals_the_sequential_model_on_the_whole_batch():
    params, batch = one_device_case(2)
    step = pipeline_value_and_grad(
        dense, mse, NUM, mesh=MESH, embed_fn=embed, repeats=2
    )
    expected = jax.value_and_grad(functools.partial(sequential, dense, mse))(
        params, batch
    )
    chex.assert_trees_all_close(
        jax.jit(step)(params, batch), expected, rtol=RTOL, atol=RTOL
    )


def test_bfloat16_gradients_keep_their_dtype_and_accumulate_in_float32():
    params, batch = one_device_case(1)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    step = pipeline_value_and_grad(dense, mse, NUM, mesh=MESH, embed_fn=embed)
    _, grads = jax.jit(step)(params, batch)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    text = jax.jit(step).lower(params, batch).as_text()
    assert "bf16" in text and "f32" in text


def test_no_embed_fn_feeds_the_micro_batch():
    params, batch = one_device_case(1)

    def stage(params, micro):
        return {**micro, "x": jnp.tanh(micro["x"] @ params["w"][:4, :4])}

    def loss(head, micro, _):
        return jnp.mean((micro["x"] @ head["w"][:4] - micro["y"]) ** 2)

    step = pipeline_value_and_grad(stage, loss, NUM, mesh=MESH)
    value, grads = jax.jit(step)((None, params[1], params[2]), batch)

    def whole(stages, head):
        x = stage(jax.tree.map(lambda p: p[0], stages), batch)
        return loss(head, x, batch)

    expected = jax.value_and_grad(whole, argnums=(0, 1))(params[1], params[2])
    chex.assert_trees_all_close((value, grads[1:]), expected, rtol=RTOL, atol=RTOL)
    assert grads[0] is None


# Errors: what, the sizes, what to do.


def build(**options):
    defaults = {"mesh": MESH, "embed_fn": embed}
    return pipeline_value_and_grad(dense, mse, NUM, **{**defaults, **options})


def call_error(step, params=None, batch=None):
    params = one_device_case(1)[0] if params is None else params
    batch = make_batch(4 * NUM) if batch is None else batch
    with pytest.raises((ValueError, TypeError)) as info:
        step(params, batch)
    return str(info.value)


def test_a_mesh_without_the_stage_axis():
    with pytest.raises(ValueError, match=r"stage_axis='stage' is not an axis") as info:
        build(mesh=jax.make_mesh((1,), ("data",)))
    assert "('data',)" in str(info.value) and "jax.make_mesh" in str(info.value)


def test_a_data_axis_the_mesh_lacks():
    with pytest.raises(ValueError, match=r"data_axis='data' is not an axis"):
        build(data_axis="data")


def test_stacked_stages_not_s_times_repeats():
    params = make_params(3)
    message = call_error(build(repeats=2), params=params)
    assert "stage_params['b'] has shape (3, 16)" in message
    assert "num_stages * repeats = 1 * 2 = 2" in message


def test_circular_schedule_with_fewer_microbatches_than_stages():
    mesh = AbstractMesh((4,), ("stage",))
    with pytest.raises(ValueError, match=r"repeats=2 needs num_microbatches >= the 4"):
        pipeline_value_and_grad(dense, mse, 3, mesh=mesh, repeats=2)
    with pytest.raises(ValueError, match=r"repeats=1 \(any M; the bubble is then 3 of"):
        pipeline_value_and_grad(dense, mse, 3, mesh=mesh, repeats=2)


def test_fewer_microbatches_than_stages_is_allowed_with_repeats_1():
    options = PipelineWindow(2, layout=PipelineLayout())
    schedule = schedule_on(AbstractMesh((4,), ("stage",)), options)
    assert schedule.num_ticks == 5 and schedule.bubble_fraction == pytest.approx(3 / 5)


def test_a_stage_that_changes_the_activation():
    def widen(params, x):
        return jnp.concatenate([dense(params, x), x], -1)

    message = call_error(
        pipeline_value_and_grad(widen, mse, NUM, mesh=MESH, embed_fn=embed)
    )
    assert "stage_fn changes the activation" in message
    assert "float32[4, 16]" in message and "float32[4, 32]" in message


def test_a_batch_that_does_not_split():
    message = call_error(build(), batch=make_batch(10))
    assert "The batch has 10 rows" in message and "multiple of" in message


def test_params_not_a_triple():
    message = call_error(build(), params=make_params(1)[:2])
    assert "(embed_params, stage_params, head_params)" in message
    assert "tuple of length 2" in message


def test_fp8_metadata_is_refused_until_the_pipeline_maxes_it():
    """The pipeline would average FP8 metadata like a gradient: refused,
    naming the leaf."""
    embed_params, stage_params, head_params = one_device_case(1)[0]
    head_params = {"w": head_params, "_overwrite_with_gradient": {"amax": jnp.ones(4)}}
    message = call_error(build(), params=(embed_params, stage_params, head_params))
    assert "params[2]['_overwrite_with_gradient']['amax'] is FP8 metadata" in message


def test_a_weighted_loss_that_is_not_a_pair():
    message = call_error(build(reduction="weighted"))
    assert "loss_fn must return (loss_sum, weight)" in message
    per_row = pipeline_value_and_grad(
        dense,
        lambda h, x, b: (mse(h, x, b), jnp.ones(len(x))),
        NUM,
        mesh=MESH,
        embed_fn=embed,
        reduction="weighted",
    )
    assert "the weight loss_fn returns must be a scalar" in call_error(per_row)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"reduction": "max"}, "reduction must be one of"),
        ({"aux_reduction": "stack"}, "aux_reduction must be one of"),
        ({"repeats": 0}, "repeats must be >= 1"),
        ({"data_axis": "stage"}, "both 'stage'"),
        ({"schedule": "zb"}, "schedule must be one of"),
        ({"stage_order": "devices"}, "stage_order must be one of"),
        (
            {"schedule": "zero-bubble", "repeats": 2},
            r"schedule='zero-bubble' with repeats=2 is not built",
        ),
    ],
)
def test_bad_options_fail_at_construction(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build(**options)


@pytest.mark.parametrize(
    ("stages", "repeats", "schedule", "expected"),
    [
        (4, 1, "1f1b", [0, 1, 2, 3]),
        (4, 2, "1f1b", [0, 4, 1, 5, 2, 6, 3, 7]),
        (2, 3, "gpipe", [0, 2, 4, 1, 3, 5]),
        (4, 2, "v-zb", [0, 7, 1, 6, 2, 5, 3, 4]),
        (3, 2, "v-half", [0, 5, 1, 4, 2, 3]),
    ],
)
def test_device_order_is_each_devices_stages_in_the_order_it_runs_them(
    stages, repeats, schedule, expected
):
    """Row d R + r of the device order is the r-th stage device d runs:
    r S + d, on the V d then 2 S - 1 - d (a permutation of the stages)."""
    order = jaxaccum.pipeline_stage_order(stages, repeats, schedule)
    assert order.tolist() == expected
    assert sorted(order.tolist()) == list(range(stages * repeats))


def test_device_order_refuses_what_its_schedule_refuses():
    with pytest.raises(ValueError, match="repeats=2 only"):
        jaxaccum.pipeline_stage_order(4, 3, "v-zb")
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        jaxaccum.pipeline_stage_order(0, 2, "1f1b")


@pytest.mark.parametrize(
    "option",
    [
        {"pad": True},
        {"masked": True},
        {"state_argnums": 2},
        {"argnums": 1},
        {"gather_dtype": jnp.bfloat16},
    ],
    ids=lambda option: next(iter(option)),
)
def test_what_a_pipeline_cannot_do_is_refused_with_why(option):
    """One options object: the core's options the pipeline does not take are
    refused by name, each with its reason."""
    (name,) = option
    with pytest.raises(
        TypeError, match=f"pipeline_value_and_grad does not take {name}: "
    ):
        build(**option)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_report_finite_names_the_micro_batch(schedule):
    """``report_finite``: micro-batch k (rows k, k + M, ...) is not finite
    exactly where one of its rows is inf; a clean window is finite."""
    params, batch = one_device_case(1)
    step = jax.jit(build(report_finite=True, schedule=schedule))
    _, report = step(params, batch)
    assert isinstance(report, jaxaccum.FiniteReport)
    assert report.microbatch_finite.tolist() == [True] * NUM and bool(report.finite)
    poisoned = {**batch, "x": batch["x"].at[NUM + 2].set(jnp.inf)}  # micro-batch 2
    _, report = step(params, poisoned)
    expected = [k != 2 for k in range(NUM)]
    assert report.microbatch_finite.tolist() == expected and not bool(report.finite)


@pytest.mark.parametrize("name", ["param_gather", "grad_reduce"])
def test_fsdp_modes_are_the_cores_and_microbatch_is_refused(name):
    """FSDP inside a stage is the core's plan: ``"window"`` and ``"auto"``
    are the pipeline's one schedule (the same numbers); ``"microbatch"``
    does not apply, and says why."""
    params, batch = one_device_case(1)
    expected = jax.jit(build())(params, batch)
    for mode in ("window", "auto"):
        got = jax.jit(build(**{name: mode}))(params, batch)
        chex.assert_trees_all_equal(got, expected)
    with pytest.raises(ValueError, match=f"{name}='microbatch' does not apply"):
        build(**{name: "microbatch"})


@pytest.mark.parametrize("unroll", [1.5, "2", None, 0, jnp.asarray(2)])
def test_unroll_is_checked_as_everywhere(unroll):
    with pytest.raises((TypeError, ValueError), match="unroll"):
        build(unroll=unroll)


def test_microbatch_size_is_the_same_window_as_its_count():
    """``microbatch_size=`` reads ``M`` off the batch: the same program as
    ``num_microbatches=M``, so the same numbers bitwise."""
    params, batch = one_device_case(1)
    rows = jax.tree.leaves(batch)[0].shape[0]
    by_count = jax.jit(build())(params, batch)
    by_size = pipeline_value_and_grad(
        dense, mse, mesh=MESH, embed_fn=embed, microbatch_size=rows // NUM
    )
    chex.assert_trees_all_equal(jax.jit(by_size)(params, batch), by_count)
    odd = pipeline_value_and_grad(
        dense, mse, mesh=MESH, embed_fn=embed, microbatch_size=rows // NUM + 1
    )
    message = call_error(odd)
    assert f"micro-batches of {rows // NUM + 1} rows" in message, message


def test_num_microbatches_must_be_an_int():
    with pytest.raises(
        TypeError, match="num_microbatches must be a positive Python int"
    ):
        pipeline_value_and_grad(dense, mse, 2.0, mesh=MESH)


def test_no_mesh():
    step = pipeline_value_and_grad(dense, mse, NUM, embed_fn=embed)
    assert "No mesh" in call_error(step)


def test_the_bubble_fraction_formula():
    for stages, num, repeats in itertools.product((2, 4, 8), (8, 16), (1, 2)):
        schedule = GPipe(stages, num, repeats)
        assert schedule.num_ticks == num * repeats + stages - 1
        np.testing.assert_allclose(
            schedule.bubble_fraction, (stages - 1) / (num * repeats + stages - 1)
        )
        if repeats == 1:  # 1F1B: the same bubble, in slots
            one = OneFOneB(stages, num)
            assert one.num_ticks == num + 2 * (stages - 1)
            assert one.bubble_fraction == schedule.bubble_fraction


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 6), num=st.integers(1, 12), repeats=st.integers(1, 3))
def test_the_modeled_window_is_the_asynchronous_schedules(stages, num, repeats):
    """Ticks in lockstep, each as long as its busiest device (F = 1, B = 2):
    GPipe computes its bubbles, 3 (M R + S - 1); 1F1B skips its bubbles'
    slots and takes 3 (M + S - 1), the asynchronous 1F1B's window, for any
    M (its ramps cost a forward and a backward per tick)."""
    assume(repeats == 1 or num >= stages)
    gpipe = GPipe(stages, num, repeats)
    assert gpipe.modeled_window() == 3 * (num * repeats + stages - 1)
    assert gpipe.useful_work / gpipe.modeled_window() == pytest.approx(
        1 - gpipe.bubble_fraction
    )
    if repeats == 1:
        assert OneFOneB(stages, num).modeled_window() == 3 * (num + stages - 1)
        # Zero-bubble (F = B = W = 1, one slot a tick, at most S micro-batches
        # held from F to W): within a tick of the asynchronous ZB-H1's for
        # M >= S (the W a full ring forces costs that tick); for fewer, the
        # first device's wait for its first B (2 S - 1 ticks) and its 2 M B
        # and W slots after it.
        window = ZeroBubble(stages, num).modeled_window()
        optimum = max(3 * num + stages - 1, 2 * num + 2 * stages - 1)
        assert window == optimum + (num >= stages > 1), (window, optimum)
        assert window < 3 * (num + stages - 1) or stages == 1


def _grid_ticks(table: np.ndarray, num: int) -> dict:
    """Each device's tick of each micro-batch's slot in ``table``, checking
    each runs once."""
    ticks = {}
    for device, row in enumerate(table):
        found = {int(m): t for t, m in enumerate(row) if m >= 0}
        assert sorted(found) == list(range(num)) and (row >= 0).sum() == num
        ticks.update({(device, m): t for m, t in found.items()})
    return ticks


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 8), num=st.integers(1, 24), recomputes=st.booleans())
def test_zero_bubble_grid_runs_each_slot_once_in_order_and_never_overwrites(
    stages, num, recomputes
):
    """Zero-bubble's tables: without remat one slot a device a tick, with it
    (``recomputes``) F and B at 1F1B's ticks; each micro-batch's F, B and W
    once on each device; F a tick after the previous device's F, B a tick
    after the next device's B (on the last device its own F's tick or
    later), W not before its B; without remat at most S micro-batches held
    from F to W (a ring of min(S, M), fewer than S stored boundaries, one
    slot per inbox: ZB-H1's memory, under 1F1B's ring of min(2 S - 1, M)),
    with remat 1F1B's ring K = min(2 S - 1, M) and at most K stored
    boundaries; and, replaying the device's
    reads and writes in the tick's order (arrivals put in, F reads its
    activation and writes its residuals, the loss's cotangent put in, B
    reads both and writes its boundary, W reads both), no slot of a ring or
    inbox is written while a micro-batch still needs it."""
    schedule = ZeroBubble(stages, num, 1, recomputes)
    grid = schedule.grid()
    slots = (grid.forward >= 0) * 1 + (grid.backward >= 0) + (grid.weight >= 0)
    if recomputes:
        one = OneFOneB(stages, num).busy_table()
        np.testing.assert_array_equal(grid.forward[:, : one.shape[1]] >= 0, one % 2)
        np.testing.assert_array_equal(grid.backward[:, : one.shape[1]] >= 0, one >= 2)
    else:
        assert (slots <= 1).all()
    f, b, w = (_grid_ticks(t, num) for t in (grid.forward, grid.backward, grid.weight))
    last = stages - 1
    for d, m in itertools.product(range(stages), range(num)):
        assert d == 0 or f[d, m] > f[d - 1, m]
        if d == last:
            assert b[d, m] >= f[d, m] + (0 if recomputes else 1)
        else:
            assert b[d, m] > b[d + 1, m] and b[d, m] > f[d, m]
        assert w[d, m] >= b[d, m] + (0 if recomputes else 1)
    if recomputes:
        assert schedule.ring_size == min(2 * stages - 1, num)
        assert schedule.stored_size <= schedule.ring_size
    else:
        sizes = (grid.ring_size, grid.inbox_size, grid.back_size)
        assert sizes == (min(stages, num), 1, 1), sizes
        assert grid.stored_size <= max(stages - 1, 1), grid.stored_size
    sizes = {
        "ring": grid.ring_size,
        "stored": grid.stored_size,
        "inbox": grid.inbox_size,
        "back": grid.back_size,
    }
    for d in range(stages):
        _replay_grid(grid, d, sizes)
    # remat's tables need no inboxes: what arrives is used in its tick, and
    # the last device's B is its F's micro-batch, in its tick.
    assert grid.immediate == recomputes or stages == 1
    if grid.immediate:
        arrived = grid.x_arrival >= 0
        np.testing.assert_array_equal(grid.x_arrival[arrived], grid.forward[arrived])
        arrived = grid.back_arrival >= 0
        np.testing.assert_array_equal(
            grid.back_arrival[arrived], grid.backward[arrived]
        )
        np.testing.assert_array_equal(grid.backward[-1], grid.forward[-1])


class _Held:
    """A device's ring and inbox slots: which micro-batch each holds."""

    def __init__(self, device: int, sizes: dict) -> None:
        self.device, self.sizes = device, sizes
        self.slots: dict = {name: {} for name in sizes}

    def put(self, name: str, micro: int) -> None:
        slot = micro % self.sizes[name]
        assert self.slots[name].get(slot) is None, (self.device, name, micro)
        self.slots[name][slot] = micro

    def take(self, name: str, micro: int, free: bool = True) -> None:
        slot = micro % self.sizes[name]
        assert self.slots[name].get(slot) == micro, (self.device, name, micro)
        if free:
            self.slots[name][slot] = None


def _replay_grid(grid, d: int, sizes: dict) -> None:
    """Device ``d``'s reads and writes, tick by tick, in the tick's order."""
    held, last = _Held(d, sizes), grid.forward.shape[0] - 1
    for t in range(grid.forward.shape[1]):
        if grid.x_arrival[d, t] >= 0:
            held.put("inbox", int(grid.x_arrival[d, t]))
        if grid.back_arrival[d, t] >= 0:
            held.put("back", int(grid.back_arrival[d, t]))
        if (m := int(grid.forward[d, t])) >= 0:
            if d > 0:
                held.take("inbox", m)
            held.put("ring", m)
            if d == last:
                held.put("back", m)
        if (m := int(grid.backward[d, t])) >= 0:
            held.take("back", m)
            held.take("ring", m, free=False)
            held.put("stored", m)
        if (m := int(grid.weight[d, t])) >= 0:
            held.take("ring", m)
            held.take("stored", m)


def layered(params, x, key=None):
    """``dense`` applied once per layer of ``params`` (``(L, ...)``), with
    an integer leaf riding along and, given a key, dropout-like noise."""
    h = x["x"] if isinstance(x, dict) else x
    for layer in range(params["w"].shape[0]):
        h = jnp.tanh(h @ params["w"][layer] + params["b"][layer])
        if key is not None:
            h = h * jax.random.bernoulli(jax.random.fold_in(key, layer), 0.9, h.shape)
    return {**x, "x": h} if isinstance(x, dict) else h


@pytest.mark.parametrize(
    "layers, remat, keyed, with_int",
    [(1, False, False, False), (3, False, True, True), (2, True, False, True)],
)
def test_the_split_backward_is_the_pullback_and_w_does_not_redo_b(
    layers, remat, keyed, with_int
):
    """Zero-bubble's B and W halves (the stage's backward split at its
    jaxpr) give the pullback's input and parameter cotangents, and W costs
    a layer's backward per layer (about the forward's FLOPs), not the
    ``2 L - 1`` a pullback with its input's cotangent dropped redoes."""
    rng = np.random.default_rng(0)
    width = 32
    params = {
        "w": jnp.asarray(rng.normal(size=(layers, width, width)) / width**0.5),
        "b": jnp.asarray(rng.normal(size=(layers, width))),
    }
    x = jnp.asarray(rng.normal(size=(16, width)))
    x = {"x": x, "n": jnp.arange(16)} if with_int else x
    key = jax.random.key(1) if keyed else None
    body = jax.checkpoint(layered) if remat else layered

    def stage(given, x):
        return body(given[0], x, given[1])

    given = (params, key)
    y, saved, pullback = forward(stage, given, x)
    cotangent = jax.tree.map(
        lambda v: (
            v
            if jnp.issubdtype(v.dtype, jnp.inexact)
            else np.zeros(v.shape, jax.dtypes.float0)
        ),
        y,
    )
    leaves, tree = jax.tree.flatten((given, saved, cotangent))

    def flat(*leaves):
        return jax.tree.leaves(backward(pullback, *jax.tree.unflatten(tree, leaves)))

    handed = len(jax.tree.leaves(cotangent))
    num_dx = len(jax.tree.leaves(backward(pullback, given, saved, cotangent)[1]))
    split = split_backward(flat, leaves, num_dx, handed)
    dx, boundary = jax.jit(lambda *a: input_part(split, a))(*leaves)
    args = [*leaves[: len(leaves) - handed], *[None] * handed]
    weights = jax.jit(lambda b: weight_part(split, args, b))(boundary)
    expected = flat(*leaves)
    chex.assert_trees_all_close(
        [w for w in weights + dx if w.dtype != jax.dtypes.float0],
        [e for e in expected if e.dtype != jax.dtypes.float0],
        rtol=1e-5,
        atol=1e-6,
    )

    def flops(fun, *args):
        return jax.jit(fun).lower(*args).compile().cost_analysis()["flops"]

    forward_flops = flops(lambda g, x: forward(stage, g, x)[:2], given, x)
    w_flops = flops(lambda b: weight_part(split, args, b), boundary)
    assert w_flops <= 1.2 * forward_flops, (w_flops, forward_flops)


def test_zero_bubble_grid_beats_every_w_placement_on_1f1b_ticks():
    """The grid's window is within a tick of the least any placement of the
    W slots on 1F1B's ticks reaches (the integer program's optimum with one
    W slot a tick, benchmarks/pipeline_zero_bubble.py, its committed rows for
    S = 2, 4, 8: the first design's bound, on 1F1B's ring of 2 S - 1
    residual slots where the grid holds S), below it at M = S (S = 4, 8),
    and a tick over the asynchronous ZB-H1's for M >= S (the W its full ring
    forces)."""
    rows = json.loads(ZERO_BUBBLE_RESULTS.read_text())["rows"]
    assert len(rows) >= 15
    for row in rows.values():
        stages, num = row["stages"], row["num_microbatches"]
        window = ZeroBubble(stages, num).modeled_window()
        optimum = row["one_slot"]["zero_bubble_window"]
        assert window <= optimum + 1, (row, window)
        if num == stages >= 4:  # where 1F1B's ticks leave the most idle
            assert window < optimum, (row, window)
        if num >= stages:
            assert window == 3 * num + stages, (row, window)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    stages=st.integers(1, 5),
    num=st.integers(1, 9),
    repeats=st.integers(1, 3),
)
def test_each_schedules_gradient_table_is_the_slot_that_computes_it(
    name, stages, num, repeats
):
    """The statistics read which micro-batch a stage's gradient comes from
    at each tick off the schedule's own table: GPipe's forward slot (autodiff
    differentiates the tick that ran it), 1F1B's backward slot (interleaved
    1F1B's too), zero-bubble's W slot."""
    if not builds(name, repeats) or (repeats > 1 and num < stages):
        return
    schedule = schedule_type(name, repeats)(stages, num, repeats)
    table = schedule.stage_gradient_table()
    assert table.shape == (stages, schedule.num_ticks, num)
    for tick, device in itertools.product(range(schedule.num_ticks), range(stages)):
        if isinstance(schedule, ZeroBubble):
            micro = int(schedule.weight_table()[device, tick])
            valid = micro >= 0
        elif isinstance(schedule, VShape):  # its W's, of either chunk
            tables = schedule.tables()
            valid, micro = tables.op[device, tick] == 2, tables.micro[device, tick]
        elif isinstance(schedule, OneFOneB):
            valid, micro = schedule.backward_at(jnp.int32(tick), jnp.int32(device))
        else:
            at = schedule.at(jnp.int32(tick), jnp.int32(device))
            valid, micro = at.valid, at.microbatch
        expected = np.zeros(num, bool)
        if bool(valid):
            expected[int(micro)] = True
        np.testing.assert_array_equal(table[device, tick], expected)


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 6), num=st.integers(1, 12))
def test_1f1b_slots_run_every_microbatch_once_each_way(stages, num):
    """1F1B: each device runs each micro-batch's forward and backward once;
    the forward one tick after the stage before's, the backward one tick
    after the stage after's (the last stage's in the tick of its forward);
    and a ring slot is not written again before its backward has read it
    (the forward slot writes before the backward slot reads)."""
    schedule = OneFOneB(stages, num)
    size = schedule.ring_size
    forward, backward = {}, {}
    for tick, device in itertools.product(range(schedule.num_ticks), range(stages)):
        at = schedule.at(jnp.int32(tick), jnp.int32(device))
        if bool(at.valid):
            assert (int(at.microbatch), device) not in forward
            forward[int(at.microbatch), device] = tick
        valid, index = schedule.backward_at(jnp.int32(tick), jnp.int32(device))
        if bool(valid):
            assert (int(index), device) not in backward
            backward[int(index), device] = tick
    assert (
        set(forward)
        == set(backward)
        == set(itertools.product(range(num), range(stages)))
    )
    for micro, device in forward:
        if device > 0:
            assert forward[micro, device] == forward[micro, device - 1] + 1
        if device < stages - 1:
            assert backward[micro, device] == backward[micro, device + 1] + 1
        else:
            assert backward[micro, device] == forward[micro, device]
        # No later micro-batch of the same slot enters before this one leaves.
        for later in range(micro + 1, num):
            if later % size == micro % size:
                assert forward[later, device] > backward[micro, device]
    assert size == min(2 * stages - 1, num)


def interleaved_slots(schedule: Interleaved) -> tuple[dict, dict, dict]:
    """Each device's forward and backward tick of each (micro-batch, repeat)
    off the schedule's traced slots (asserting each runs once), and the ring
    slot each forward writes."""
    forward, backward, slots = {}, {}, {}
    tables = schedule.tables()
    for tick, device in itertools.product(
        range(schedule.num_ticks), range(schedule.num_stages)
    ):
        at = schedule.at(jnp.int32(tick), jnp.int32(device))
        if bool(at.valid):
            key = (int(at.microbatch), int(at.repeat), device)
            assert key not in forward, (key, tick)
            forward[key] = tick
            slots[key] = int(tables.forward_slot[device, tick])
        back = schedule.backward_slot(jnp.int32(tick), jnp.int32(device))
        if bool(back.valid):
            key = (int(back.microbatch), int(back.repeat), device)
            assert key not in backward, (key, tick)
            backward[key] = tick
            assert int(tables.backward_slot[device, tick]) == slots[key], key
    return forward, backward, slots


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 5), num=st.integers(1, 11), repeats=st.integers(2, 3))
def test_interleaved_slots_run_every_stage_once_each_way(stages, num, repeats):
    """Interleaved 1F1B: each device runs each (micro-batch, repeat)'s
    forward and backward once; model stage l + 1's forward runs the tick
    after stage l's, on the next device round the ring (no wait), and its
    backward the tick before stage l's; the last stage's backward in the
    tick of its forward (its loss); a ring slot is not written again before
    the backward of what it holds has read it (in a tick, the forward writes
    before the backward reads), and the ring is the most a device holds."""
    schedule = Interleaved(stages, num, repeats)
    forward, backward, slots = interleaved_slots(schedule)
    every = set(itertools.product(range(num), range(repeats), range(stages)))
    assert set(forward) == set(backward) == every
    layers = stages * repeats
    for micro, layer in itertools.product(range(num), range(layers)):
        here = (micro, layer // stages, layer % stages)
        assert backward[here] >= forward[here]
        if layer == layers - 1:
            assert backward[here] == forward[here]
            continue
        after = (micro, (layer + 1) // stages, (layer + 1) % stages)
        assert forward[after] == forward[here] + 1, (here, after)
        assert backward[here] == backward[after] + 1, (here, after)
    held = []
    for device in range(stages):
        mine = [key for key in every if key[2] == device]
        for key, other in itertools.product(mine, mine):
            if key != other and slots[key] == slots[other]:
                first, then = sorted((key, other), key=forward.get)
                assert forward[then] > backward[first], (first, then)
        held += [
            sum(forward[k] <= tick < backward[k] for k in mine) + 1
            for tick in range(schedule.num_ticks)
        ]
    assert schedule.ring_size <= max(held)
    assert schedule.ring_size <= min((repeats + 1) * stages - 1, num * repeats)


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 6), groups=st.integers(1, 4), repeats=st.integers(1, 4))
def test_interleaved_window_is_the_asynchronous_ideal(stages, groups, repeats):
    """With M a multiple of S, interleaved 1F1B's modeled window (F = 1, B =
    2 per stage, 1/R of a device's) is 3 M R + 3 (S - 1): the asynchronous
    interleaved schedule's, 1F1B's fill and drain over R; R = 1 is 1F1B's
    ticks and window."""
    num = groups * stages
    schedule = Interleaved(stages, num, repeats)
    assert schedule.modeled_window() == 3 * num * repeats + 3 * (stages - 1)
    assert schedule.bubble_fraction == pytest.approx(
        GPipe(stages, num, repeats).bubble_fraction
    )
    if repeats == 1:
        one = OneFOneB(stages, num)
        assert schedule.num_ticks == one.num_ticks
        np.testing.assert_array_equal(schedule.busy_table(), one.busy_table())


def test_interleaved_window_against_1f1b_at_4_stages():
    """The issue's figures at S = 4, R = 2 (the window over R: 1F1B's units):
    at most 0.82 of 1F1B's at M = 4, 0.95 at M = 16; a group short of S
    costs its padded slots."""
    ratios = {
        num: Interleaved(4, num, 2).modeled_window()
        / 2
        / OneFOneB(4, num).modeled_window()
        for num in (3, 4, 7, 8, 16)
    }
    assert ratios[4] == pytest.approx(16.5 / 21) and ratios[4] <= 0.82, ratios
    assert ratios[16] == pytest.approx(52.5 / 57) and ratios[16] <= 0.95, ratios
    assert ratios[3] == pytest.approx(15 / 18) and ratios[7] < 1, ratios


@settings(max_examples=8, deadline=None)
@given(
    repeats=st.sampled_from([2, 3]),
    reduction=st.sampled_from(["mean", "sum", "weighted"]),
    with_key=st.booleans(),
    remat=st.sampled_from([False, True, jax.checkpoint_policies.dots_saveable]),
    stats=st.booleans(),
    loss_scale=st.booleans(),
    skip=st.booleans(),
)
def test_interleaved_options_against_gpipe_circular(
    repeats, reduction, with_key, remat, stats, loss_scale, skip
):
    """On one device (S = 1, R stages on it): interleaved 1F1B with every
    reduction (weighted with aux), keys, remat, report_stats, a loss scale,
    its bubble slots skipped or computed on a NaN fill, equals GPipe's
    circular schedule on the same options (RTOL: the same sums in another
    order), with the same statistics."""
    params, batch = one_device_case(repeats)
    key = jax.random.key(3) if with_key else None
    weighted = reduction == "weighted"
    functions = (
        noisy_dense if with_key else dense,
        weighted_mse if weighted else mse,
        noisy_embed if with_key else embed,
    )
    scale = {"loss_scale": jaxaccum.dynamic_loss_scale()} if loss_scale else {}
    outs = {}
    for kind in ("gpipe", "1f1b"):
        options = PipelineWindow(
            NUM,
            has_aux=weighted,
            reduction=reduction,
            remat=remat,
            report_stats=stats,
            loss_scale=loss_scale,
            layout=PipelineLayout(repeats=repeats, schedule=kind),
        )
        fill = float("nan") if kind == "1f1b" and not skip else 0.0
        step = make_pipeline(functions, options, MESH, fill, skip)
        outs[kind] = jax.jit(step)(params, batch, key, **scale)
    chex.assert_tree_all_finite(outs["1f1b"])
    chex.assert_trees_all_close(outs["1f1b"], outs["gpipe"], rtol=RTOL, atol=RTOL)


def test_a_key_no_function_takes():
    params, batch = one_device_case(1)
    step = pipeline_value_and_grad(
        lambda p, x: dense(p, x),
        mse,
        NUM,
        mesh=MESH,
        embed_fn=lambda p, micro_batch: embed(p, micro_batch),
    )
    with pytest.raises(TypeError, match="none of stage_fn, loss_fn and embed_fn"):
        step(params, batch, jax.random.key(0))


def test_only_functions_with_a_key_parameter_get_one():
    assert takes_key(noisy_dense) and takes_key(lambda **kw: 0)
    assert not takes_key(mse) and not takes_key(None)


# A float16 loss scale through the pipeline: test_loss_scale.py's model (its
# derived bound) as embed (``tanh(x W1)``), one stage multiplying by an
# exact 1 (no rounding), and the head (``c mean(boost z w2)``).


def f16_pipeline(num, **options):
    return pipeline_value_and_grad(
        lambda ones, z: z * ones,
        lambda w2, z, b: f16_loss({"W1": None, "w2": w2, "z": z}, b),
        num,
        mesh=MESH,
        embed_fn=lambda w1, b: jnp.tanh(b["x"].astype(w1.dtype) @ w1),
        **options,
    )


def f16_loss(params, batch):
    """test_loss_scale.f16_loss from the hidden activation ``z`` on."""
    out = (params["z"] @ params["w2"]).astype(jnp.float32)
    return loss_scale_tests.LOSS_WEIGHT * jnp.mean(batch["boost"] * out)


def f16_pipeline_params(dtype=jnp.float16):
    params = loss_scale_tests.f16_params(dtype)
    ones = jnp.ones((1, loss_scale_tests.HIDDEN), dtype)  # S R = 1 stage
    return params["W1"], ones, params["w2"]


@pytest.mark.parametrize("num", [2, 4])
def test_float16_loss_scale_through_the_pipeline_matches_float32(num):
    """Scaled, the float16 window is the float32 big batch's within the
    bound test_loss_scale.py derives; unscaled, the hidden layer's gradient
    underflows to zero."""
    params, batch = f16_pipeline_params(), loss_scale_tests.f16_batch()
    as_dict = {"W1": params[0], "w2": params[2]}
    reference = jax.grad(loss_scale_tests.f16_loss)(
        loss_scale_tests.f16_params(jnp.float32), batch
    )
    tolerance = loss_scale_tests.f16_tolerance(as_dict, batch, reference, num)
    step = jax.jit(f16_pipeline(num, loss_scale=True))
    (_, grads), report = step(params, batch, loss_scale=jaxaccum.dynamic_loss_scale())
    assert isinstance(report, jaxaccum.LossScaleReport) and bool(report.finite)
    for name, grad in (("W1", grads[0]), ("w2", grads[2])):
        assert grad.dtype == jnp.float16, grad.dtype
        loss_scale_tests.assert_within(name, grad, reference[name], tolerance[name])
    _, unscaled = jax.jit(f16_pipeline(num))(params, batch)
    assert not np.any(np.asarray(unscaled[0])), unscaled[0]


def test_an_overflow_skips_the_pipeline_window():
    """One overflowing row: the window is not finite, the scale backs off,
    and select_if_finite keeps the parameters bitwise."""
    params = f16_pipeline_params()
    batch = loss_scale_tests.f16_batch(overflow_row=5)
    scale = jaxaccum.dynamic_loss_scale()
    step = jax.jit(f16_pipeline(4, loss_scale=True, report_stats=True))
    (_, grads), report = step(params, batch, loss_scale=scale)
    assert not bool(report.finite)
    assert float(report.loss_scale.loss_scale) < float(scale.loss_scale)
    assert isinstance(report.report, jaxaccum.WindowStats)
    updated = jax.tree.map(lambda p, g: p - g, params, grads)
    kept = jaxaccum.select_if_finite(report.finite, updated, params)
    chex.assert_trees_all_equal(kept, params)
    with pytest.raises(TypeError, match="keyword argument loss_scale"):
        step(params, batch)


# The window's counts and aux, the core's rules (issue 45's cases 1 and 6).


def counted_mse(params, x, micro_batch):
    """A weighted loss whose weights are token counts (~10k a row: 160k a
    window), with an exact integer aux summed past float32's integers."""
    rows = jnp.sum((x @ params["w"] - micro_batch["y"]) ** 2, -1)
    count = micro_batch["count"]
    loss_sum = jnp.sum(count.astype(jnp.float32) * rows)
    return (loss_sum, jnp.sum(count)), {"big": jnp.sum(micro_batch["big"])}


def counted_step(**options):
    return pipeline_value_and_grad(
        dense,
        counted_mse,
        NUM,
        mesh=MESH,
        embed_fn=embed,
        reduction="weighted",
        has_aux=True,
        **options,
    )


def counted_batch(count_dtype):
    batch = make_batch(4 * NUM)
    rng = np.random.default_rng(5)
    counts = rng.integers(9_000, 11_000, 4 * NUM)
    big = np.full(4 * NUM, 2**23 + 1, np.int32)  # sum 2**27 + 16: not a float32
    return {**batch, "count": jnp.asarray(counts, count_dtype), "big": jnp.asarray(big)}


@pytest.mark.parametrize("accum_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("count_dtype", [jnp.int32, jnp.float32])
def test_counts_sum_in_at_least_float32_and_integer_aux_exactly(
    accum_dtype, count_dtype
):
    """Token counts summed in float16 overflow (the window read 0), in
    bfloat16 round by 0.4%; an int32 aux summed through float32 loses 8. The
    window sums both as the core does: counts in at least float32 (integers
    exactly), integer aux in int32. The parameters are float32, so nothing
    else is in the low-precision dtype: RTOL holds."""
    params, batch = one_device_case(1)[0], counted_batch(count_dtype)
    step = counted_step(aux_reduction="sum", accum_dtype=accum_dtype)
    (value, aux), grads = jax.jit(step)(params, batch)

    def whole(params):
        x = dense(jax.tree.map(lambda p: p[0], params[1]), embed(params[0], batch))
        (total, weight), aux = counted_mse(params[2], x, batch)
        return total / weight, aux

    (expected, expected_aux), expected_grads = jax.value_and_grad(whole, has_aux=True)(
        params
    )
    chex.assert_trees_all_close(
        (value, grads), (expected, expected_grads), rtol=RTOL, atol=RTOL
    )
    assert aux["big"].dtype == jnp.int32 and int(aux["big"]) == 16 * (2**23 + 1)
    assert int(expected_aux["big"]) == int(aux["big"])


def test_an_aux_prefix_of_mean_and_sum_as_in_the_core():
    params, batch = one_device_case(1)[0], counted_batch(jnp.int32)
    (_, aux), _ = jax.jit(counted_step(aux_reduction={"big": "sum"}))(params, batch)
    assert int(aux["big"]) == 16 * (2**23 + 1)
    (_, aux), _ = jax.jit(counted_step(aux_reduction={"big": "mean"}))(params, batch)
    assert aux["big"].dtype == jnp.float32
    chex.assert_trees_all_close(aux["big"], jnp.float32(4 * (2**23 + 1)))
    with pytest.raises(ValueError, match="prefix of the aux output"):
        build(has_aux=True, aux_reduction={"big": "stack"})


SCHEDULE_CASES = {  # (schedule, repeats): each strategy class once
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved": ("1f1b", 2),
    "zero-bubble": ("zero-bubble", 1),
}


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_python_scalars_in_aux_are_reduced_as_the_core_reduces_them(case):
    """Issue 62, case 4: an aux holding Python numbers failed on every
    schedule ('int' object has no attribute 'dtype'). The core returns it:
    its value and aux are the pipeline's, the gradient the sequential
    model's (RTOL)."""
    schedule, repeats = SCHEDULE_CASES[case]
    params, batch = make_params(repeats), make_batch(4 * NUM)
    reductions = {"count": "mean", "rate": "mean", "total": "sum"}

    def with_aux(loss):
        return lambda *args: (loss(*args), {"count": 3, "rate": 0.5, "total": 3})

    step = pipeline_value_and_grad(
        dense,
        with_aux(mse),
        NUM,
        mesh=MESH,
        embed_fn=embed,
        repeats=repeats,
        schedule=schedule,
        has_aux=True,
        aux_reduction=reductions,
    )
    (value, aux), grads = jax.jit(step)(params, batch)
    core = jaxaccum.value_and_grad(
        with_aux(functools.partial(sequential, dense, mse)),
        num_microbatches=NUM,
        has_aux=True,
        aux_reduction=reductions,
    )
    (expected, expected_aux), expected_grads = jax.jit(core)(params, batch)
    chex.assert_trees_all_equal(aux, expected_aux)
    chex.assert_trees_all_equal_dtypes(aux, expected_aux)
    assert int(aux["total"]) == 3 * NUM
    chex.assert_trees_all_close(
        (value, grads), (expected, expected_grads), rtol=RTOL, atol=RTOL
    )


def complex_params(repeats):
    """The one-device model with complex weights: each a real matrix times a
    unit phase, so that the stages stay as Lipschitz as the real ones and
    the activation is complex from the embedding on."""
    embed_params, stages, head = make_params(repeats)

    def rotate(w, angle):
        return w * jnp.exp(1j * angle).astype(jnp.complex64)

    return (
        {"w": rotate(embed_params["w"], 0.2)},
        {**stages, "w": rotate(stages["w"], 0.1)},
        {"w": rotate(head["w"], -0.1)},
    )


def squared_error(params, x, micro_batch):
    return jnp.mean(jnp.abs(x @ params["w"] - micro_batch["y"]) ** 2)


@pytest.mark.parametrize("remat", [False, jax.checkpoint_policies.dots_saveable])
@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_complex_parameters_as_the_sequential_model(case, remat):
    """Issue 62, case 5: complex parameters failed inside JAX on every
    schedule (reduce_precision does not accept dtype complex64: the stage's
    checkpoint saved a complex value), with remat=False too. The core
    differentiates them as jax.value_and_grad does; so does the pipeline.
    Tolerance: pipeline_checks' float32 bound with twice the terms per
    contraction (a complex product's parts each sum two real products)."""
    schedule, repeats = SCHEDULE_CASES[case]
    params, batch = complex_params(repeats), make_batch(4 * NUM)
    step = pipeline_value_and_grad(
        dense,
        squared_error,
        NUM,
        mesh=MESH,
        embed_fn=embed,
        repeats=repeats,
        schedule=schedule,
        remat=remat,
    )
    value, grads = jax.jit(step)(params, batch)
    expected = jax.value_and_grad(functools.partial(sequential, dense, squared_error))(
        params, batch
    )
    rtol = tolerance(2.0**-24, features=2 * FEATURES)
    chex.assert_trees_all_close((value, grads), expected, rtol=rtol, atol=rtol)
    chex.assert_trees_all_equal_dtypes(grads, params)


# The planner (its choice against an exhaustive search on 8 devices is
# pipeline_checks.py's plan_pipeline_stage4_data2).


def planned(**options):
    repeats = options.get("repeats", 2)
    params, micro = make_params(repeats), make_batch(64)
    defaults = {"mesh": MESH, "embed_fn": embed, "repeats": 2, "memory_budget": "1GiB"}
    with compiles_to_read():  # the plan reads memory and FLOPs, runs nothing
        return jaxaccum.plan_pipeline(
            dense, mse, params, micro, **{**defaults, **options}
        )


def test_plan_pipeline_grows_the_window_and_remats_only_when_it_must():
    """One stage has no bubble: every window without remat is fully
    efficient, so remat (a forward pass again) is never compiled while one
    fits, and the largest candidate is chosen; a budget only remat's
    smallest window meets gets it."""
    roomy = planned(candidates=[1, 2, 4, 8])
    assert (roomy.num_microbatches, roomy.remat, roomy.efficiency) == (8, False, 1.0)
    assert {row.remat for row in roomy.rows} == {False}
    assert roomy.batch_size == 8 * 64 and roomy.bubble == 0.0
    assert 0 < roomy.recompute < 1 and roomy.recompute_measured
    plain = planned(candidates=[1], remat=False).footprint_bytes
    rematted = planned(candidates=[1], remat=True).footprint_bytes
    assert rematted < plain, (rematted, plain)
    tight = planned(candidates=[1, 2, 4, 8], memory_budget=rematted)
    assert (tight.num_microbatches, tight.remat) == (1, True)
    assert tight.efficiency == pytest.approx(1 / (1 + tight.recompute))
    assert tight.footprint_bytes <= rematted
    assert "<- chosen" in str(tight) and "remat=True" in str(tight)


def test_plan_pipeline_refuses_what_it_chooses_and_says_when_nothing_fits():
    with pytest.raises(TypeError, match="chooses the window's num_microbatches"):
        planned(num_microbatches=4)
    with pytest.raises(TypeError, match="chooses the window's num_microbatches"):
        planned(microbatch_size=4)
    with pytest.raises(ValueError, match="candidates is empty"):
        planned(candidates=[])
    with pytest.raises(ValueError, match="candidate num_microbatches"):
        planned(candidates=[0, 2])
    with pytest.raises(TypeError, match="plan_pipeline does not take masked"):
        planned(masked=True)
    with pytest.raises(ValueError, match=r"No window fits.*\n.*M\s+schedule\s+remat"):
        planned(candidates=[1, 2], memory_budget=1000)


def test_plan_pipeline_candidates_below_the_stages_with_repeats():
    """Issue 62, case 9: a candidate M < S with repeats > 1 was refused by
    circular GPipe's rule even for schedule="1f1b", whose interleaved ticks
    run it (interleaved_checks.py's stage4_data2_M3_R2). Refused now only
    where no planned schedule runs it; GPipe skips it where 1F1B plans it."""
    from jaxaccum._pipeline._plan import _check_candidates

    gpipe, interleaved = [("gpipe", False)], [("1f1b", False), ("1f1b", True)]
    assert _check_candidates(None, 4, 1, gpipe) == [4, 8, 16, 32, 64, 128]
    assert _check_candidates([8, 4, 8], 4, 2, gpipe) == [4, 8]
    assert _check_candidates([2, 8], 4, 2, interleaved) == [2, 8]
    assert _check_candidates([1, 8], 4, 2, gpipe + interleaved) == [1, 8]
    refusal = "candidate num_microbatches=2: schedule='gpipe' with repeats=2 needs"
    with pytest.raises(ValueError, match=refusal) as info:
        _check_candidates([2, 8], 4, 2, gpipe)
    assert "schedule='1f1b' (interleaved 1F1B runs any M)" in str(info.value)


def test_the_docstrings_say_which_schedules_take_repeats():
    """Issue 62, case 10: the docstrings denied interleaved 1F1B ("1f1b" was
    "repeats=1 only", M >= S whenever R > 1). A schedule's entry says
    "repeats=1 only" exactly where its class is not built for R > 1; the
    README's features name every schedule."""
    doc = inspect.getdoc(pipeline_value_and_grad)
    entry = doc.split("\n  schedule:")[1].split("\n  **options:")[0]
    marks = [entry.index(f'``"{name}"``') for name in SCHEDULES]
    assert marks == sorted(marks), entry
    parts = [entry[a:b] for a, b in zip(marks, [*marks[1:], None], strict=True)]
    for name, part in zip(SCHEDULES, parts, strict=True):
        assert ("repeats=1`` only" in part) == (not builds(name, 2)), (name, part)
    rule = doc.split("\n  num_microbatches:")[1].split("\n  mesh:")[0]
    assert "circular GPipe" in rule, rule
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    features = " ".join(readme.split("\n\n")[2].split())
    for schedule in ("GPipe", "1F1B", "interleaved 1F1B", "zero-bubble"):
        assert schedule in features, (schedule, features)


def test_plan_pipeline_checks_remat_as_the_step_does():
    with pytest.raises((TypeError, ValueError), match="remat"):
        planned(remat="yes")


@pytest.mark.parametrize("exponent", [64, 80])
def test_pipeline_stats_under_a_large_scale_are_the_unscaled_ones(exponent):
    """The probes squared each piece's scaled gradient: at a scale of 2**64
    that overflows float32 (inf squared norms, a window still finite). The
    scale is divided out of each leaf before squaring (issue 45, case 3)."""
    params = f16_pipeline_params(jnp.float32)
    batch = loss_scale_tests.f16_batch()
    plain = jax.jit(f16_pipeline(4, report_stats=True))(params, batch)
    step = jax.jit(f16_pipeline(4, report_stats=True, loss_scale=True))
    scale = jaxaccum.dynamic_loss_scale(2.0**exponent)
    out, report = step(params, batch, loss_scale=scale)
    assert bool(report.finite)
    chex.assert_trees_all_close((out, report.report), plain, rtol=RTOL)
    assert float(report.report.microbatch_grad_sq_norm.min()) > 0


# Issue 45's pipeline errors: jaxaccum's own message, or the right result.


def test_integer_and_bool_leaves_ride_through_the_stages():
    """Labels and masks carried in the activation (embed_fn=None) failed in
    the stage's gated backward ("float0 is not a valid dtype"): they have no
    gradient, and the result is the sequential model's."""
    params, batch = one_device_case(1)
    batch = {**batch, "label": jnp.arange(16) % 3, "keep": jnp.arange(16) % 2 == 0}

    def stage(params, micro):
        return {**micro, "x": jnp.tanh(micro["x"] @ params["w"][:4, :4])}

    def loss(head, micro, _):
        error = micro["x"] @ head["w"][:4] - micro["y"] - micro["label"][:, None]
        return jnp.mean(jnp.where(micro["keep"][:, None], error**2, 0))

    step = pipeline_value_and_grad(stage, loss, NUM, mesh=MESH)
    value, grads = jax.jit(step)((None, params[1], params[2]), batch)

    def whole(stages, head):
        return loss(head, stage(jax.tree.map(lambda p: p[0], stages), batch), batch)

    expected = jax.value_and_grad(whole, argnums=(0, 1))(params[1], params[2])
    chex.assert_trees_all_close((value, grads[1:]), expected, rtol=RTOL, atol=RTOL)


class Parts(NamedTuple):
    embed: Any
    stages: Any
    head: Any


@pytest.mark.parametrize("container", [list, Parts], ids=["list", "namedtuple"])
def test_gradients_have_the_params_container(container):
    """Params given as a list or a NamedTuple came back as a plain tuple of
    gradients, so optax.apply_updates failed on the structures."""
    params, batch = one_device_case(1)
    given = container(params) if container is list else container(*params)
    _, grads = jax.jit(build())(given, batch)
    assert type(grads) is container
    updated = optax.apply_updates(given, grads)
    assert jax.tree.structure(updated) == jax.tree.structure(given)


def test_an_integer_parameter_is_refused_naming_it():
    params, batch = one_device_case(1)
    params = (params[0], {**params[1], "step": jnp.zeros(1, jnp.int32)}, params[2])
    message = call_error(build(), params=params, batch=batch)
    assert "params[1]['step'] has dtype int32" in message, message


def test_a_mesh_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        pipeline_value_and_grad(dense, mse, NUM, mesh="stage", embed_fn=embed)
    step = pipeline_value_and_grad(
        dense, mse, NUM, mesh=MESH.abstract_mesh, embed_fn=embed
    )
    params, batch = one_device_case(1)
    with pytest.raises(ValueError, match="inside `with jax.set_mesh"):
        step(params, batch)
    with jax.set_mesh(MESH):  # its abstract mesh is the one set
        loss, _ = jax.jit(step)(params, batch)
    assert bool(jnp.isfinite(loss))


def test_has_aux_with_a_bare_loss_says_so():
    message = call_error(build(has_aux=True))
    assert "With has_aux=True, loss_fn must return a pair (loss, aux)" in message


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "loss",
    [lambda h, x, b: jnp.sum(x @ h["w"] > 0), lambda h, x, b: jnp.any(x > 0)],
    ids=["count", "bool"],
)
def test_an_integer_or_bool_loss_is_refused_naming_its_dtype(schedule, loss):
    """Issue 55, case 1: a count or bool loss came back divided by M in
    integer arithmetic with every gradient exactly 0 (training never moved);
    jax.value_and_grad refuses such a loss, and so does the pipeline."""
    step = pipeline_value_and_grad(
        dense, loss, NUM, mesh=MESH, embed_fn=embed, schedule=schedule
    )
    message = call_error(step)
    dtype = jax.eval_shape(loss, {"w": jnp.ones(16)}, jnp.ones((4, 16)), None).dtype
    assert f"loss_fn must return a float loss, got dtype {dtype}" in message, message


# The pipeline's options, drawn (issue 45): the dtypes of the loss (issue 55),
# weights, aux and activations, accum_dtype, unroll, mesh forms, params
# containers, reports and the loss scale, against the sequential model on the
# whole batch; an integer or bool loss is refused, naming its dtype.

PIPELINE_CHOICES = {
    "reduction": ["mean", "sum", "weighted"],
    "weight_dtype": [jnp.int32, jnp.float32],
    "aux_dtype": [jnp.int32, jnp.float32],
    "aux_reduction": ["mean", "sum"],
    "accum_dtype": [None, jnp.float32, jnp.float16, jnp.bfloat16],
    "unroll": [1, 2, True],
    "abstract_mesh": [False, True],
    "container": [tuple, list, Parts],
    "report": [None, "report_stats", "report_finite"],
    "scale_exponent": [None, 0, 64, 80],
    "repeats": [1, 2],
    "schedule": ["gpipe", "1f1b", "zero-bubble", "v-zb", "v-half"],
    "loss_dtype": [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_],
}
PIPELINE_OPTIONS = {name: st.sampled_from(v) for name, v in PIPELINE_CHOICES.items()}


# A bfloat16 loss is rounded to it (unit roundoff 2**-9) once per micro-batch
# and once as the window's value, against once for the whole batch; each
# gradient is the float32 one times the loss's cotangent, rounded to bfloat16
# once on either side: a relative error of at most 3 * 2**-9 < 2**-7 on top of
# float32's.
LOSS_RTOL = {jnp.dtype(jnp.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0**-7}


def drawn_loss(reduction, weight_dtype, aux_dtype, loss_dtype=jnp.float32):
    """A loss with token counts of ~10k a row (a window of 160k: float16
    overflows), an aux past float32's integers (int32) and a bool mask
    carried in the activation; its loss (loss sum) in ``loss_dtype``."""

    def loss(head, micro, _):
        rows = jnp.sum((micro["x"] @ head["w"][:4] - micro["y"]) ** 2, -1)
        rows = jnp.where(micro["keep"], rows, 0)
        count = micro["count"].astype(weight_dtype)
        big = jnp.sum(micro["big"]).astype(aux_dtype)
        if reduction == "weighted":
            total = jnp.sum(count.astype(jnp.float32) * rows)
            return (total.astype(loss_dtype), jnp.sum(count)), big
        if reduction == "sum":
            return jnp.sum(rows).astype(loss_dtype), big
        return jnp.mean(rows).astype(loss_dtype), big

    return loss


def drawn_stage(params, micro):
    return {**micro, "x": jnp.tanh(micro["x"] @ params["w"][:4, :4] + params["b"][:4])}


EXAMPLE = {  # every option at its first value, then each issue-45 case
    name: strategy.elements[0] for name, strategy in PIPELINE_OPTIONS.items()
}


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(**PIPELINE_OPTIONS)
@example(  # case 1: token counts summed in float16 overflowed
    **{**EXAMPLE, "reduction": "weighted", "accum_dtype": jnp.float16}
)
@example(  # case 6: an int32 aux summed as float32; case 3: stats at 2**64
    **{
        **EXAMPLE,
        "aux_dtype": jnp.int32,
        "aux_reduction": "sum",
        "report": "report_stats",
        "scale_exponent": 64,
    }
)
@example(**{**EXAMPLE, "loss_dtype": jnp.int32})  # issue 55, case 1
@example(**{**EXAMPLE, "loss_dtype": jnp.bool_, "schedule": "1f1b"})
@example(
    **{
        **EXAMPLE,
        "schedule": "zero-bubble",
        "reduction": "weighted",
        "report": "report_stats",
        "scale_exponent": 64,
    }
)
@example(
    **{**EXAMPLE, "loss_dtype": jnp.bfloat16, "reduction": "weighted", "repeats": 2}
)
@example(
    **{
        **EXAMPLE,
        "schedule": "v-half",
        "repeats": 2,
        "reduction": "weighted",
        "report": "report_stats",
        "scale_exponent": 64,
    }
)
def test_pipeline_options_drawn_against_the_sequential_model(
    reduction,
    weight_dtype,
    aux_dtype,
    aux_reduction,
    accum_dtype,
    unroll,
    abstract_mesh,
    container,
    report,
    scale_exponent,
    repeats,
    schedule,
    loss_dtype,
):
    assume(schedule != "zero-bubble" or repeats == 1)  # 1F1B: R = 1 (refused else)
    assume(not schedule.startswith("v-") or repeats == 2)  # the V: R = 2
    params = make_params(repeats)
    batch = counted_batch(weight_dtype)
    batch = {**batch, "keep": jnp.arange(4 * NUM) % 3 != 0}
    loss = drawn_loss(reduction, weight_dtype, aux_dtype, loss_dtype)
    options = {"report_stats": True} if report == "report_stats" else {}
    options |= {"report_finite": True} if report == "report_finite" else {}
    options |= {"loss_scale": True} if scale_exponent is not None else {}
    step = pipeline_value_and_grad(
        drawn_stage,
        loss,
        NUM,
        mesh=MESH.abstract_mesh if abstract_mesh else MESH,
        repeats=repeats,
        reduction=reduction,
        has_aux=True,
        aux_reduction=aux_reduction,
        accum_dtype=accum_dtype,
        unroll=unroll,
        schedule=schedule,
        **options,
    )
    given_params = (None, params[1], params[2])
    given_params = (
        container(*given_params) if container is Parts else container(given_params)
    )
    call = (
        {}
        if scale_exponent is None
        else {"loss_scale": jaxaccum.dynamic_loss_scale(2.0**scale_exponent)}
    )
    with jax.set_mesh(MESH) if abstract_mesh else contextlib.nullcontext():
        if not jnp.issubdtype(loss_dtype, jnp.floating):
            refused = f"must return a float loss, got dtype {jnp.dtype(loss_dtype)}"
            with pytest.raises(TypeError, match=refused):
                jax.jit(step)(given_params, batch, **call)
            return
        out = jax.jit(step)(given_params, batch, **call)
    report_out = None
    if scale_exponent is not None:
        out, scaled = out
        assert bool(scaled.finite)
        report_out = scaled.report if report else None
    elif report:
        out, report_out = out
    (value, aux), grads = out
    assert type(grads) is container

    def whole(stages, head):
        micro = batch
        for layer in range(repeats):
            micro = drawn_stage(jax.tree.map(lambda p, i=layer: p[i], stages), micro)
        out, big = loss(head, micro, None)
        if reduction == "weighted":
            total, weight = out
            return total / weight, big
        return out, big  # a mean of NUM equal pieces is the whole batch's

    (expected, _), expected_grads = jax.value_and_grad(whole, (0, 1), has_aux=True)(
        params[1], params[2]
    )
    assert value.dtype == loss_dtype, value.dtype
    rtol = RTOL + LOSS_RTOL[jnp.dtype(loss_dtype)]
    chex.assert_trees_all_close(
        (value, tuple(grads)[1:]), (expected, expected_grads), rtol=rtol, atol=RTOL
    )
    pieces = [int(jnp.sum(batch["big"][k::NUM])) for k in range(NUM)]
    if aux_reduction == "sum":
        assert aux.dtype == aux_dtype, aux.dtype
        assert float(aux) == float(jnp.asarray(sum(pieces), aux_dtype))
    else:
        chex.assert_trees_all_close(aux, jnp.float32(sum(pieces) / NUM), rtol=RTOL)
    if report == "report_stats":
        assert float(report_out.microbatch_grad_sq_norm.min()) > 0
        assert bool(jnp.all(jnp.isfinite(report_out.microbatch_grad_sq_norm)))
    if report == "report_finite":
        assert bool(report_out.finite)


@functools.cache
def exhaustive_footprints(repeats: int) -> dict:
    """Every (schedule, remat, M)'s footprint and efficiency, each compiled
    alone (zero-bubble with repeats=1 only; 1F1B interleaved with
    repeats > 1)."""
    table = {}
    schedules = tuple(name for name in SCHEDULES if builds(name, repeats))
    for schedule, remat, num in itertools.product(schedules, (False, True), (2, 4, 8)):
        if schedule.startswith("v-") and remat:  # not built: plan_pipeline skips it
            continue
        one = planned(
            candidates=[num],
            schedule=schedule,
            remat=remat,
            repeats=repeats,
            memory_budget=2**40,
        )
        table[schedule, remat, num] = (one.footprint_bytes, one.efficiency)
    return table


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(
    repeats=st.sampled_from([1, 2]),
    schedule=st.sampled_from(["choose", "gpipe", "1f1b", "zero-bubble"]),
    remat=st.sampled_from(["choose", False, True]),
    candidates=st.sampled_from([(2, 4, 8), (4, 8), (2, 8)]),
    budget_at=st.integers(0, 5),
)
def test_plan_pipeline_options_drawn_against_the_exhaustive_search(
    repeats, schedule, remat, candidates, budget_at
):
    """For drawn repeats, schedule and remat (chosen, or given), candidates
    and budgets (each a compiled footprint), the plan is the most efficient
    fitting configuration of the exhaustive table, with that footprint, and
    on a tie of efficiencies the first registered (GPipe, 1F1B, zero-bubble)."""
    assume(repeats == 1 or schedule in ("choose", "gpipe"))
    table = exhaustive_footprints(repeats)
    budget = sorted(f for f, _ in table.values())[budget_at]
    remats = (False, True) if remat == "choose" else (remat,)
    schedules = tuple(SCHEDULES) if schedule == "choose" else (schedule,)
    fitting = {
        key: value
        for key, value in table.items()
        if key[0] in schedules
        and key[1] in remats
        and key[2] in candidates
        and value[0] <= budget
    }
    options = {} if remat == "choose" else {"remat": remat}
    if schedule != "choose":
        options["schedule"] = schedule
    run = functools.partial(
        planned, candidates=candidates, repeats=repeats, memory_budget=budget
    )
    if not fitting:
        with pytest.raises(ValueError, match="No window fits"):
            run(**options)
        return
    plan = run(**options)
    best = max(e for _, e in fitting.values())
    assert plan.efficiency == best, (plan, fitting)
    key = (plan.schedule, plan.remat, plan.num_microbatches)
    assert key in fitting and plan.footprint_bytes == fitting[key][0]
    ties = {k[0] for k, (_, e) in fitting.items() if e == best}
    assert plan.schedule == next(n for n in SCHEDULES if n in ties), (plan, ties)


# Malformed arguments to plan_pipeline (issue 55's cases 4 to 6 first): each
# is refused with jaxaccum's message naming the argument, before anything is
# compiled, whatever the valid options beside it.
MALFORMED = {
    "loss_scale": (
        {"loss_scale": True},
        "plan_pipeline does not take loss_scale: a loss scale changes neither",
    ),
    "candidates-int": (
        {"candidates": 4},
        r"candidates must be an iterable of positive ints.*got 4 of type int "
        r"\(for one: candidates=\[4\]\)",
    ),
    "microbatch-scalar": (
        {"microbatch": {"x": jnp.ones(()), "y": jnp.ones(())}},
        r"microbatch\['x'\] is a scalar \(shape \(\)\)",
    ),
    "candidates-str": ({"candidates": "48"}, "got '48' of type str"),
    "candidates-zero": (
        {"candidates": [2, 0]},
        "each candidate num_microbatches must be >= 1, got 0",
    ),
    "candidates-float": (
        {"candidates": [2.5]},
        "each candidate num_microbatches must be a positive Python int, got 2.5",
    ),
    "microbatch-rows": (
        {"microbatch": {"x": jnp.ones((4, 4)), "y": jnp.ones(3)}},
        r"microbatch\['x'\]: 4, microbatch\['y'\]: 3",
    ),
    "microbatch-empty": (
        {"microbatch": {"x": jnp.ones((0, 4)), "y": jnp.ones(0)}},
        r"microbatch\['x'\] has 0 rows",
    ),
    "params-pair": (
        {"params": "pair"},
        r"params = \(embed_params, stage_params, head_params\).*tuple of length 2",
    ),
    "num_microbatches": ({"num_microbatches": 4}, "do not pass num_microbatches"),
    "masked": ({"masked": True}, "plan_pipeline does not take masked"),
    "remat": ({"remat": "yes"}, "remat must be True, False"),
    "schedule": (
        {"schedule": "1f2b"},
        r"schedule must be one of \('gpipe', '1f1b', 'zero-bubble', 'v-zb', 'v-half'\)",
    ),
    "memory_budget": ({"memory_budget": "lots"}, "Cannot read memory_budget='lots'"),
    "reduction": ({"reduction": "avg"}, "reduction must be one of"),
}


def no_compile(*_, **__):
    raise AssertionError("plan_pipeline compiled before refusing its arguments")


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    malformed=st.sampled_from(list(MALFORMED)),
    repeats=st.sampled_from([1, 2]),
    schedule=st.sampled_from([None, "gpipe", "1f1b", "zero-bubble"]),
    remat=st.sampled_from([None, False, True]),
    abstract=st.booleans(),
)
@example(malformed="loss_scale", repeats=1, schedule=None, remat=None, abstract=False)
@example(
    malformed="candidates-int", repeats=2, schedule=None, remat=None, abstract=False
)
@example(
    malformed="microbatch-scalar", repeats=1, schedule="1f1b", remat=True, abstract=True
)
def test_plan_pipeline_refuses_drawn_malformed_arguments_before_compiling(
    malformed, repeats, schedule, remat, abstract
):
    """Issue 55: ``candidates=4`` failed with "'int' object is not
    iterable", a micro-batch of scalars with an IndexError, ``loss_scale``
    with a message about calling the step; each drawn malformed argument,
    beside drawn valid options (given as arrays or shapes), is refused with
    its own message before anything compiles."""
    assume(repeats == 1 or schedule in (None, "gpipe"))  # 1F1B, ZB: R = 1
    params, micro = make_params(repeats), make_batch(64)
    bad, message = MALFORMED[malformed]
    arguments = {
        "params": params,
        "microbatch": micro,
        "mesh": MESH,
        "embed_fn": embed,
        "repeats": repeats,
        "memory_budget": "1GiB",
        "candidates": [2, 4],
    }
    arguments |= {"schedule": schedule} if schedule else {}
    arguments |= {"remat": remat} if remat is not None else {}
    arguments |= bad
    if bad.get("params") == "pair":
        arguments["params"] = params[:2]
    if abstract:
        arguments["params"], arguments["microbatch"] = jax.eval_shape(
            lambda tree: tree, (arguments["params"], arguments["microbatch"])
        )
    with (
        unittest.mock.patch("jaxaccum._pipeline._plan._recompute", no_compile),
        unittest.mock.patch("jaxaccum._pipeline._plan._measure", no_compile),
        pytest.raises((TypeError, ValueError), match=message),
    ):
        jaxaccum.plan_pipeline(dense, mse, **arguments)


def test_plan_pipeline_takes_1f1b_where_only_its_window_fits():
    """At a budget between 1F1B's and GPipe's footprints at the largest M
    (S = 1: 1F1B's ring is one slot, GPipe keeps every tick's input), the
    plan is 1F1B's largest window, which GPipe's memory cannot reach;
    with repeats > 1 "1f1b" (interleaved) is planned too."""
    candidates = (2, 8)
    table = exhaustive_footprints(1)
    one_f_one_b, gpipe = table["1f1b", False, 8][0], table["gpipe", False, 8][0]
    assert one_f_one_b < gpipe, table
    plan = planned(candidates=candidates, repeats=1, memory_budget=one_f_one_b)
    assert (plan.schedule, plan.num_microbatches) == ("1f1b", 8), str(plan)
    assert "schedule='1f1b'" in str(plan)
    interleaved = planned(candidates=candidates, schedule="1f1b", repeats=2)
    assert interleaved.schedule == "1f1b", str(interleaved)
