"""The suite's XLA optimisation level (tests/conftest.py says why): the flag
the main run appends to ``XLA_FLAGS``, where the flags it started with are
kept, and whether this process compiles at ``-O0``."""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"
# XLA_FLAGS as the run was started: the notebooks' kernels get these.
USER_XLA_FLAGS = "JAXACCUM_TESTS_USER_XLA_FLAGS"


def compile_fast() -> None:
    """Appends ``FAST_COMPILE`` to ``XLA_FLAGS`` before any backend starts,
    unless the run asks for the default level or sets a level itself."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAXACCUM_TESTS_DEFAULT_LEVEL") == "1":
        return
    if "xla_backend_optimization_level" in flags:
        return  # set by the user, or by the pytest process that started this one
    os.environ[USER_XLA_FLAGS] = flags
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()


def compiled_at_lowest_level() -> bool:
    """Whether this process's XLA compiles at ``-O0`` (the suite's main run),
    where one computation in two programs (a forward and the same forward
    inside a backward pass) may round differently, as on two instruction
    sets; a claim of bit-for-bit equality between two programs is proved
    where XLA compiles at its default level (CI's claims rerun)."""
    return FAST_COMPILE in os.environ.get("XLA_FLAGS", "")
