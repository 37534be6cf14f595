"""Sharded parameters (replicated, FSDP, tensor parallel, both) through the
window, on 8 forced CPU devices: ``sharded_checks.py`` runs every check in one
subprocess (the device count is fixed when JAX starts). Tolerances (float32):
rtol=1e-5, atol=1e-6 against the single-device full-batch gradient.
"""

import pytest
from check_scripts import run_script
from sharded_checks import CHECKS


@pytest.fixture(scope="module")
def results() -> dict:
    return run_script("sharded_checks.py", num_devices=8, timeout=600)


@pytest.mark.parametrize("check", CHECKS)
def test_sharded(results, check):
    assert results[check]["ok"], results[check]["detail"]
