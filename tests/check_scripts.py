"""Checks that need more devices than the test process has run as scripts in
a subprocess (the device count is fixed when JAX starts its backend): the
script reports every check as one JSON line, the test module reads it."""

import json
import os
import pathlib
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence

TESTS = pathlib.Path(__file__).parent


def device_env(num_devices: int) -> dict:
    """The environment of a subprocess with ``num_devices`` CPU devices.

    The device count is appended to the caller's ``XLA_FLAGS``, so a cap such as
    ``--xla_cpu_max_isa=AVX`` (CI's instruction-set runs) reaches the subprocess.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    return {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={num_devices}",
        "JAX_PLATFORMS": "cpu",
    }


def report(checks: Sequence[str], run: Callable[[str], str], num_devices: int):
    """A check script's main: runs each check (those named on the command
    line, else all) and prints ``{name: {"ok": bool, "detail": str}}``."""
    import jax

    assert jax.device_count() == num_devices, (
        f"{jax.device_count()} devices; run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices}"
    )
    results = {}
    for name in sys.argv[1:] or checks:
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "detail": run(name)}
        except Exception:  # report every check, not just the first failure
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        # What each check costs, for finding the slow ones (not asserted).
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results))


def selected_checks(request) -> list[str]:
    """The ``check`` parameters of the requesting module's tests that this
    session runs: all of them, unless ``-m``, ``-k`` or node ids left some out
    (CI's instruction-set reruns run a few: tests/conftest.py's CLAIMS)."""
    return [
        item.callspec.params["check"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "check" in getattr(getattr(item, "callspec", None), "params", {})
    ]


def run_script(
    script: str, num_devices: int, timeout: float, checks: Sequence[str] = ()
) -> dict:
    """Runs a check script in a subprocess (the checks named, else all);
    returns their results by name."""
    process = subprocess.run(
        [sys.executable, str(TESTS / script), *checks],
        env=device_env(num_devices),
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert process.returncode == 0, (
        f"{script} exited with {process.returncode}:\n{process.stderr[-4000:]}"
    )
    return json.loads(process.stdout.strip().splitlines()[-1])
