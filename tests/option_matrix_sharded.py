"""The sharded part of the option matrix on 8 CPU devices, run by
test_option_matrix.py in its own process (the device count is fixed when JAX
starts): ``shard_value_and_grad`` with replicated and FSDP parameters on
``data`` meshes of 2 and 4 devices and a ``data`` x ``model`` mesh (4 x 2),
every other axis of the matrix drawn as in process (see option_matrix.py).

Each group named on the command line runs as one hypothesis test; the last
line of stdout is ``{group: {"ok": bool, "detail": str}}`` (check_scripts).
bfloat16 FSDP parameters on the data x model mesh are a group of their own,
run in a process of their own: XLA:CPU has aborted on them, and an abort
must not take the other results with it.
"""

import collections
import os

from check_scripts import report
from hypothesis import HealthCheck, given, settings
from option_matrix import SHARD_PATHS, Case, cases, check_case

NUM_DEVICES = 8
MESHES = ("data2", "data4", "data4_model2")
DEFAULT_EXAMPLES = {"sharded": 10, "bf16_fsdp_data_model": 3, "batch_nodes": 8}


def _bf16_fsdp_data_model(case: Case) -> bool:
    combo = case.combo
    return (combo.path, combo.mesh, combo.dtype) == (
        "shard_fsdp",
        "data4_model2",
        "bfloat16",
    )


GROUPS = {
    "sharded": cases(SHARD_PATHS, MESHES).filter(
        lambda case: not _bf16_fsdp_data_model(case)
    ),
    "bf16_fsdp_data_model": cases(("shard_fsdp",), ("data4_model2",), ("bfloat16",)),
    # A registered batch node, each device's share labelled with its rows.
    "batch_nodes": cases(SHARD_PATHS, ("data2", "data4"), batch_node=True),
}


def run(group: str) -> str:
    """Runs one group's property test; returns what its examples did."""
    examples = int(
        os.environ.get("JAXACCUM_MATRIX_SHARDED_EXAMPLES", DEFAULT_EXAMPLES[group])
    )
    outcomes: collections.Counter = collections.Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize="JAXACCUM_MATRIX_EXAMPLES" not in os.environ,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(GROUPS[group])
    def matches_full_batch(case: Case) -> None:
        outcomes[check_case(case)] += 1

    matches_full_batch()
    return f"{sum(outcomes.values())} examples: {dict(outcomes)}"


if __name__ == "__main__":
    report(list(GROUPS), run, NUM_DEVICES)
