"""Marks the tests whose results depend on float rounding: ``numerics``.

XLA's CPU backend picks its vector code from the host, so summation order and
fused multiply-adds (and with them float32 rounding) differ between machines.
CI runs the ``numerics`` tests again under the instruction sets other than the
host's (``--xla_cpu_max_isa=AVX``, ``AVX2``; ``pytest -m "numerics and not
slow"``); docs/development.md has the full matrix.

A test is ``numerics`` unless rounding cannot change its outcome:

- the modules below check imports, compiled memory (a byte count the
  instruction set does not change), the command line's output and the built
  site;
- a test whose own body raises on bad input (``pytest.raises`` or
  ``pytest.warns``) and compares no values (no tolerance, no equality of
  arrays) checks an error message, which no instruction set changes.

Everything else (every comparison against the big batch, the doctests, the
docs pages' examples, the notebooks) is rerun.
"""

import ast
import functools
import inspect
import re

import pytest

NOT_NUMERICS = {"test_layout.py", "test_memory.py", "test_cli.py", "test_site.py"}
# The 8-device sharded matrix (about 2 minutes): its values are the same sums
# the single-device tests check under every instruction set, and its main
# claims (which collectives, how many bytes) are read from the compiled HLO,
# which the instruction set does not change. CI runs it once, in the main run.
# The pipeline's 8-device checks (about a minute) likewise: their window sums
# are checked in process against the micro-batch reference under every
# instruction set (test_pipeline.py's own tests), their bubble FLOPs and
# collectives are read from the compiled HLO.
SLOW = {"test_sharded.py", "test_pipeline.py::test_pipeline_on_8_devices"}
EXPECTS_AN_ERROR = re.compile(r"\bpytest\.(raises|warns)\(")
COMPARES_VALUES = re.compile(
    r"tol\b|TOL\b|close|approx|_equal|_match|==|float\(|\.item\(|tolist|"
    r"assert_trees|allclose|isclose|finite|\bnan\b|isnan"
)


@functools.cache
def _checks_only_errors(function) -> bool:
    """Whether a test function's body expects an error and compares nothing."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    tree = ast.parse(inspect.cleandoc("\n" + source))
    body = tree.body[0]
    if isinstance(body, ast.FunctionDef) and ast.get_docstring(body):
        body.body = body.body[1:]  # the docstring's words are not code
    code = ast.unparse(body)
    return bool(EXPECTS_AN_ERROR.search(code)) and not COMPARES_VALUES.search(code)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        error_only = function is not None and _checks_only_errors(function)
        if item.path.name not in NOT_NUMERICS and not error_only:
            item.add_marker(pytest.mark.numerics)
        if item.path.name in SLOW or item.nodeid.split("[")[0].endswith(
            tuple(f"/{name}" for name in SLOW)
        ):
            item.add_marker(pytest.mark.slow)
