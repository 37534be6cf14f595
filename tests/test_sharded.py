"""Sharded parameters (replicated, FSDP, tensor parallel, both) through the
window, on 8 forced CPU devices: ``sharded_checks.py`` runs every check in one
subprocess (the device count is fixed when JAX starts). Tolerances (float32):
RTOL, ATOL (tests/tolerances.py) against the single-device full-batch gradient.

Also frozen array arguments, positional and keyword (``frozen_*``: passed
into the ``shard_map``, replicated or sharded, on Auto and Explicit meshes),
and bfloat16 FSDP parameters (``bfloat16_*``, ``plan_modes_bfloat16_fsdp``:
gradients reduced in float32, within a per-element bound derived from
bfloat16's 8 significant bits; see ``check_bfloat16_grads``).
"""

import pytest
from check_scripts import run_script, selected_checks
from sharded_checks import CHECKS


@pytest.fixture(scope="module")
def results(request) -> dict:
    checks = selected_checks(request)
    return run_script("sharded_checks.py", num_devices=8, timeout=900, checks=checks)


@pytest.mark.parametrize("check", CHECKS)
def test_sharded(results, check):
    assert results[check]["ok"], results[check]["detail"]
