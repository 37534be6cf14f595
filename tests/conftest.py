"""Marks the tests whose results depend on float rounding: ``numerics``.

XLA's CPU backend picks its vector code from the host, so summation order and
fused multiply-adds (and with them float32 rounding) differ between machines.
CI runs the ``numerics`` tests again under ``--xla_cpu_max_isa=AVX`` and
``AVX2`` (``pytest -m "numerics and not slow"``); docs/development.md has the
full matrix.
Every test compares values against a tolerance except those of the modules
below, which check imports, compiled memory, the command line's output and the
built site's links.
"""

import pytest

NOT_NUMERICS = {"test_layout.py", "test_memory.py", "test_cli.py", "test_site.py"}
# The 8-device sharded matrix (about 2 minutes): its values are the same sums
# the single-device tests check under every instruction set, and its main
# claims (which collectives, how many bytes) are read from the compiled HLO,
# which the instruction set does not change. CI runs it once, in the main run.
SLOW = {"test_sharded.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name not in NOT_NUMERICS:
            item.add_marker(pytest.mark.numerics)
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)
