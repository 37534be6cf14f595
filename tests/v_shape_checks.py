"""schedule="v-zb" (repeats=2) on 8 CPU devices, run as a script by
test_v_shape.py (the device count is fixed when JAX starts): float64
exactness against the sequential model on stage=2 x data=4 and stage=4 x
data=2 at M = S, 2 S and 3; the compiled loop's collectives."""

import sys

import jax
from check_scripts import report
from pipeline_checks import EXACT_BY_NAME, check_float64

SCHEDULE = "v-zb"
# (name, mesh shape, mesh axes, data axis, M, R): pipeline_checks' cases.
V_SHAPE = (
    ("stage2_data4_M2_R2", (2, 4), ("stage", "data"), "data", 2, 2),
    ("stage2_data4_M4_R2", (2, 4), ("stage", "data"), "data", 4, 2),
    ("stage2_data4_M3_R2", (2, 4), ("stage", "data"), "data", 3, 2),
    ("stage4_data2_M4_R2", (4, 2), ("stage", "data"), "data", 4, 2),
    ("stage4_data2_M8_R2", (4, 2), ("stage", "data"), "data", 8, 2),
    ("stage4_data2_M3_R2", (4, 2), ("stage", "data"), "data", 3, 2),
)
EXACT_BY_NAME.update({case[0]: case for case in V_SHAPE})

CHECKS = [f"float64_{case[0]}" for case in V_SHAPE]


def run(name: str) -> str:
    """Runs check ``name`` (one of CHECKS)."""
    if name.startswith("float64_"):
        return check_float64(name.removeprefix("float64_"), SCHEDULE)
    raise KeyError(name)


if __name__ == "__main__":
    print(jax.__version__, file=sys.stderr)
    sys.exit(report(CHECKS, run, 8))
