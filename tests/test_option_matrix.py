"""The option matrix, property-tested: every front end under every option
gives the full-batch value, gradients, aux and statistics.

Axes (option_matrix.py draws them; a cell is compiled once per batch shape):
reduction (mean, sum, weighted) x report_stats x pad (a batch N does not
divide, per device) x aux (none, or each of AUX_REDUCTIONS) x parameter dtype
(float32, bfloat16, complex64 with a real loss) x front end (value_and_grad,
grad, shard_value_and_grad with replicated or FSDP parameters,
jaxaccum.equinox.filter_value_and_grad, jaxaccum.flax's Linen and NNX) x a
non-differentiated argument (none, positional, keyword) x a PRNG-key batch
leaf x N in 1..4. Documented errors are asserted where the matrix meets them
(pad with mean; per-micro-batch aux under shard_map). The statistics are
checked against a direct per-micro-batch computation over the strided split,
for every reduction those of the per-example-mean gradients.

In process there is one device, so shard_value_and_grad runs on a 1-device
mesh here; option_matrix_sharded.py runs the sharded front ends on 8 devices
in a subprocess. The tolerances are derived in option_matrix.py's docstring.

The masked matrix (``masked_cases``): masked x {num_microbatches,
microbatch_size} x reduction x aux x report_stats x dtype x front end
(value_and_grad, Equinox, Linen, NNX) x k active of N (traced: an int32 array
or a Python int under jit), against the first k micro-batches alone; plus
counts out of 1..N (refused where concrete, no plausible number under jit)
and active_microbatches passed to a function built without masked (refused).

Profiles: 30 examples in process, 8 masked per front end and a few sharded,
derandomized, for CI; ``JAXACCUM_MATRIX_EXAMPLES=3000`` runs that many of each
in process (of each front end, masked) and a quarter as many per sharded group (or
``JAXACCUM_MATRIX_SHARDED_EXAMPLES``), with fresh randomness.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from option_matrix import (
    CORE_PATHS,
    MASKED_PATHS,
    SHARD_PATHS,
    Case,
    Combo,
    build,
    cases,
    check_case,
    check_masked_case,
    check_result,
    check_stats,
    inputs,
    make_data,
    masked_cases,
    per_example,
    unpack,
)
from option_matrix_sharded import GROUPS, NUM_DEVICES

TESTS = os.path.dirname(os.path.abspath(__file__))
LONG_EXAMPLES = int(os.environ.get("JAXACCUM_MATRIX_EXAMPLES", "0"))
FAST_EXAMPLES = 30
FAST_MASKED_EXAMPLES = 8  # per front end
# The long profile runs past pytest-timeout's limit (pyproject.toml): none then.
pytestmark = [pytest.mark.timeout(0)] if LONG_EXAMPLES else []


@settings(
    max_examples=LONG_EXAMPLES or FAST_EXAMPLES,
    deadline=None,
    derandomize=not LONG_EXAMPLES,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases(CORE_PATHS + SHARD_PATHS))
def test_option_matrix_matches_full_batch(case):
    event(check_case(case))


@settings(
    max_examples=LONG_EXAMPLES or FAST_EXAMPLES // 2,
    deadline=None,
    derandomize=not LONG_EXAMPLES,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases(CORE_PATHS + SHARD_PATHS, batch_node=True))
def test_registered_batch_nodes_match_full_batch(case):
    """A batch node registered with a resize (option_matrix.Rows) reaches the
    loss labelled with the rows it holds, whatever the split: N = 1, N > 1,
    microbatch_size, pad (one padded micro-batch too), every front end; the
    loss scales by rows held over rows labelled, so a wrong label is a wrong
    value. The sharded group ``batch_nodes`` runs them on 2 and 4 devices."""
    event(check_case(case))


# One test per front end, so the fast profile draws from every one of them.
@pytest.mark.parametrize("path", MASKED_PATHS)
@settings(
    max_examples=LONG_EXAMPLES or FAST_MASKED_EXAMPLES,
    deadline=None,
    derandomize=not LONG_EXAMPLES,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_masked_matrix_matches_the_first_k_micro_batches(path, data):
    """masked=True with k of N micro-batches active equals the first k alone;
    a count out of 1..N is refused where concrete and gives no plausible
    number under jit; active_microbatches without masked is refused."""
    event(check_masked_case(data.draw(masked_cases((path,)))))


def sharded_env() -> dict:
    """This environment with 8 CPU devices: the device count appended to
    XLA_FLAGS, whose other flags (--xla_cpu_max_isa, say) are kept."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    if LONG_EXAMPLES:
        env.setdefault(
            "JAXACCUM_MATRIX_SHARDED_EXAMPLES", str(max(LONG_EXAMPLES // 4, 1))
        )
    return env


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_option_matrix_sharded(group):
    """Each group in a process of its own, so that a crash stays its own."""
    process = subprocess.run(
        [sys.executable, os.path.join(TESTS, "option_matrix_sharded.py"), group],
        env=sharded_env(),
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=None if LONG_EXAMPLES else 600,
    )
    assert process.returncode == 0, (
        f"option_matrix_sharded.py {group} exited with {process.returncode}:\n"
        f"{process.stderr[-4000:]}"
    )
    result = json.loads(process.stdout.strip().splitlines()[-1])[group]
    assert result["ok"], result["detail"]
    print(result["detail"])


def _one_row_dropped(case: Case):
    """The case's outcome computed without its last row (and its data)."""
    data = make_data(case)
    short = dataclasses.replace(case, local_size=case.local_size - 1)
    short_data = data._replace(x=data.x[:-1], weight=data.weight[:-1])
    outcome = unpack(case.combo, build(short.combo)(*inputs(short, short_data)))
    return data, outcome


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "complex64"])
def test_tolerance_catches_wrong_answers(dtype):
    """A test that cannot fail is none: a value and a gradient that lost one
    example of eight, and squared norms off by one part in a thousand (in
    twenty for bfloat16), are flagged."""
    combo = Combo("value_and_grad", "sum", True, True, None, dtype, "none", False, 2)
    case = Case(combo, 8, seed=3)
    data, outcome = _one_row_dropped(case)
    per = per_example(data, dtype == "complex64")
    with pytest.raises(AssertionError, match="value"):
        check_result(case, outcome, data, per)
    with pytest.raises(AssertionError, match="grads"):
        check_result(case, outcome._replace(value=None), data, per)
    outcome = unpack(combo, build(combo)(*inputs(case, data)))
    # bfloat16 gradients round to 8 bits per micro-batch: 2**-7 of the norm.
    relative_error = 5e-2 if dtype == "bfloat16" else 1e-3
    check_stats(case, outcome.stats, data, per)
    for name in ("microbatch_grad_sq_norm", "grad_sq_norm"):
        wrong = np.asarray(getattr(outcome.stats, name)) * (1 + relative_error)
        with pytest.raises(AssertionError, match=name):
            check_stats(case, outcome.stats._replace(**{name: wrong}), data, per)
