"""Sharded parameters (replicated, FSDP, tensor parallel, both) through the
window, on 8 forced CPU devices: ``sharded_checks.py`` runs every check in one
subprocess (the device count is fixed when JAX starts). Tolerances (float32):
rtol=1e-5, atol=1e-6 against the single-device full-batch gradient.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from sharded_checks import CHECKS

TESTS = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def results() -> dict:
    process = subprocess.run(
        [sys.executable, str(TESTS / "sharded_checks.py")],
        env={
            **os.environ,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
        },
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", CHECKS)
def test_sharded(results, check):
    assert results[check]["ok"], results[check]["detail"]
