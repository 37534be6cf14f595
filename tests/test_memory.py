"""jaxaccum.plan / parse_memory_budget: the memory planner.

Footprints are checked against an independent ``memory_analysis()`` of
``jax.jit(jaxaccum.value_and_grad(loss, N))``, and compilations are counted by
wrapping ``jaxaccum._plan._plan._compile``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import mlp_loss

import jaxaccum
from jaxaccum._plan import _plan as memory

SIZES = (16, 64, 64, 4)
BATCH_SIZE = 96
DIVISORS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
MAX_COMPILES = math.ceil(math.log2(len(DIVISORS))) + 2


def _shapes():
    params = [
        {
            "w": jax.ShapeDtypeStruct((fan_in, fan_out), jnp.float32),
            "b": jax.ShapeDtypeStruct((fan_out,), jnp.float32),
        }
        for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:], strict=True)
    ]
    batch = {
        "x": jax.ShapeDtypeStruct((BATCH_SIZE, SIZES[0]), jnp.float32),
        "y": jax.ShapeDtypeStruct((BATCH_SIZE,), jnp.int32),
    }
    return params, batch


def _footprint(num_microbatches: int, params, batch) -> int:
    step = jax.jit(jaxaccum.value_and_grad(mlp_loss, num_microbatches))
    analysis = step.lower(params, batch).compile().memory_analysis()
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


@pytest.fixture(scope="module")
def footprints() -> dict[int, int]:
    """Measured footprint of every divisor N of the batch, in bytes."""
    params, batch = _shapes()
    measured = {num: _footprint(num, params, batch) for num in DIVISORS}
    values = [measured[num] for num in DIVISORS]
    assert values == sorted(values, reverse=True), (
        f"precondition: the MLP's footprint should not grow with N, got {measured}"
    )
    return measured


@pytest.fixture
def compiled(monkeypatch) -> list:
    """Records every step that plan compiles."""
    steps: list = []
    compile_step = memory._compile

    def counting_compile(fun, args, donate_argnums):
        steps.append(fun)
        return compile_step(fun, args, donate_argnums)

    monkeypatch.setattr(memory, "_compile", counting_compile)
    return steps


@pytest.mark.parametrize("boundary, real_arrays", [(1, False), (5, False), (5, True)])
def test_plan_picks_fewest_microbatches_that_fit(
    footprints, compiled, boundary, real_arrays
):
    # A budget between the footprints of DIVISORS[boundary - 1] and
    # DIVISORS[boundary]: the latter is the answer.
    budget = (footprints[DIVISORS[boundary - 1]] + footprints[DIVISORS[boundary]]) // 2
    params, batch = _shapes()
    if real_arrays:
        params, batch = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), (params, batch)
        )

    result = jaxaccum.plan(mlp_loss, params, batch, memory_budget=budget)

    chosen = result.num_microbatches
    smaller = DIVISORS[DIVISORS.index(chosen) - 1]
    assert footprints[chosen] <= budget, (footprints[chosen], budget)
    assert footprints[smaller] > budget, (smaller, footprints[smaller], budget)
    assert chosen == DIVISORS[boundary], (chosen, footprints, budget)
    assert result.microbatch_size == BATCH_SIZE // chosen
    assert result.batch_size == BATCH_SIZE
    assert result.memory_budget == budget
    assert result.footprint_bytes == footprints[chosen]
    assert len(compiled) <= MAX_COMPILES, (len(compiled), MAX_COMPILES)
    assert len(compiled) == len(result.rows), (len(compiled), result.rows)
    for row in result.rows:
        assert row.total_bytes == footprints[row.num_microbatches], row
        assert row.fits == (row.total_bytes <= budget), row
        assert row.microbatch_size * row.num_microbatches == BATCH_SIZE, row
    compiled_nums = [row.num_microbatches for row in result.rows]
    assert compiled_nums == sorted(compiled_nums)
    assert smaller in compiled_nums, "the neighbour that does not fit was measured"


def test_plan_compiles_once_when_the_full_batch_fits(footprints, compiled):
    result = jaxaccum.plan(mlp_loss, *_shapes(), memory_budget="1GiB")
    assert result.num_microbatches == 1
    assert result.footprint_bytes == footprints[1]
    assert len(compiled) == 1, len(compiled)


def test_plan_honours_candidates(footprints, compiled):
    budget = footprints[4]
    result = jaxaccum.plan(
        mlp_loss, *_shapes(), memory_budget=budget, candidates=[16, 2, 8, 2]
    )
    assert result.num_microbatches == 8
    assert [row.num_microbatches for row in result.rows] == [2, 8, 16]
    assert len(compiled) == 3


def test_impossible_budget_raises_with_figures(footprints, compiled):
    smallest = min(footprints.values())
    budget = smallest - 1
    with pytest.raises(ValueError, match="No number of micro-batches fits") as error:
        jaxaccum.plan(mlp_loss, *_shapes(), memory_budget=budget)
    message = str(error.value)
    assert f"({budget} bytes)" in message, message
    assert f"({smallest} bytes)" in message, message
    assert f"num_microbatches={BATCH_SIZE}" in message, message
    assert len(compiled) == 2, "the smallest and the largest N only"


def test_optimizer_state_counts(footprints):
    params, batch = _shapes()
    param_bytes = sum(
        math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(params)
    )
    result = jaxaccum.plan(
        mlp_loss,
        params,
        batch,
        memory_budget="1GiB",
        candidates=[4],
        optimizer=optax.adam(1e-3),
    )
    (row,) = result.rows
    assert result.includes_optimizer
    # Adam's two moments are extra arguments; updated parameters and moments
    # are written into the donated buffers.
    assert row.total_bytes >= footprints[4] + 2 * param_bytes, (
        row,
        footprints[4],
        param_bytes,
    )
    assert row.alias_bytes >= 3 * param_bytes, (row, param_bytes)
    assert "grads + optimizer update" in str(result)


def test_str_shows_the_table(footprints):
    budget = footprints[3]
    result = jaxaccum.plan(
        mlp_loss, *_shapes(), memory_budget=budget, candidates=[1, 3, 6]
    )
    text = str(result)
    lines = text.splitlines()
    assert f"num_microbatches={result.num_microbatches}" in lines[0], text
    assert lines[1].split() == [
        "N",
        "micro-batch",
        "temp",
        "total",
        "compile",
        "s",
        "fits",
    ]
    assert len(lines) == 2 + len(result.rows), text
    assert sum("<- chosen" in line for line in lines) == 1, text
    chosen_line = next(line for line in lines if "<- chosen" in line)
    assert chosen_line.split()[0] == str(result.num_microbatches), text


def test_plan_rejects_bad_arguments():
    params, batch = _shapes()
    with pytest.raises(TypeError, match="num_microbatches"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1GiB", num_microbatches=2)
    with pytest.raises(ValueError, match=r"num_microbatches=5 does not divide"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1GiB", candidates=[5])
    with pytest.raises(ValueError, match="candidates is empty"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1GiB", candidates=[])
    # Found beside plan_pipeline's in issue 55 (case 5): "'int' object is not
    # iterable".
    with pytest.raises(TypeError, match=r"candidates must be an iterable.*got 4 of"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1GiB", candidates=4)
    with pytest.raises(TypeError, match="batch_argnums"):
        jaxaccum.plan(mlp_loss, params, memory_budget="1GiB")
    with pytest.raises(TypeError, match="plan does not take masked=True"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1GiB", masked=True)
    with pytest.raises(ValueError, match="Unknown unit"):
        jaxaccum.plan(mlp_loss, params, batch, memory_budget="1G")


@pytest.mark.parametrize(
    "budget, expected",
    [
        ("512MB", 512 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1.5 gib", 3 * 2**29),
        (" 64 KiB ", 64 * 1024),
        ("0.1GB", 10**8),
        ("100", 100),
        ("100b", 100),
        (".5KB", 500),
        ("3TB", 3 * 10**12),
        (4096, 4096),
        (2e9, 2 * 10**9),
        (np.int64(7), 7),
    ],
)
def test_parse_memory_budget(budget, expected):
    assert jaxaccum.parse_memory_budget(budget) == expected


@pytest.mark.parametrize(
    "budget, match",
    [
        ("", "Cannot read"),
        ("   ", "Cannot read"),
        ("-1GB", "Cannot read"),
        ("GB", "Cannot read"),
        ("1.2.3MB", "Cannot read"),
        ("2G", "Unknown unit 'g'"),
        ("2 GiBs", "Unknown unit 'gibs'"),
        ("5 bits", "Unknown unit"),
        ("0MB", "at least 1 byte"),
        (0, "at least 1 byte"),
        (-5, "at least 1 byte"),
        (0.5, "at least 1 byte"),
        (float("inf"), "finite"),
        (float("nan"), "finite"),
    ],
)
def test_parse_memory_budget_rejects(budget, match):
    with pytest.raises(ValueError, match=match):
        jaxaccum.parse_memory_budget(budget)


@pytest.mark.parametrize("budget", [None, True, [1024], b"1GB"])
def test_parse_memory_budget_rejects_types(budget):
    with pytest.raises(TypeError, match="memory_budget must be"):
        jaxaccum.parse_memory_budget(budget)


def test_device_budget_on_cpu_raises():
    if jax.local_devices()[0].memory_stats():
        pytest.skip("this device reports memory statistics")
    with pytest.raises(ValueError, match=r"memory_stats\(\) returned None"):
        jaxaccum.parse_memory_budget("device")


def test_device_budget_reads_bytes_limit(monkeypatch):
    class FakeDevice:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 2**30}

    monkeypatch.setattr(jax, "local_devices", lambda: [FakeDevice()])
    assert jaxaccum.parse_memory_budget("Device") == 80 * 2**30


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"loss_scale": True}, "plan_modes does not take loss_scale"),
        ({"param_gather": "window"}, "plan_modes does not take param_gather"),
        ({"grad_reduce": "window"}, "plan_modes does not take grad_reduce"),
        ({"rduction": "sum"}, "plan_modes got an unknown keyword argument 'rduction'"),
    ],
)
def test_plan_modes_checks_its_keywords_under_its_own_name(keywords, message):
    """plan_modes forwarded its keywords to shard_value_and_grad unchecked:
    loss_scale got the per-call message, param_gather Python's "multiple
    values", a typo was reported under another function's name (issue 45)."""
    with pytest.raises(TypeError, match=message):
        jaxaccum.plan_modes(
            lambda w, x: jnp.mean(x @ w),
            jnp.ones(2),
            jnp.ones((4, 2)),
            num_microbatches=2,
            memory_budget="1GiB",
            **keywords,
        )
