"""Collectives in a compiled program, inside its loops and outside."""

import re
from typing import Any

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(
    r"(body|condition|calls|to_apply|true_computation|false_computation)"
    r"=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(compiled: Any) -> dict[str, dict[str, int]]:
    """Counts the collectives of a compiled step, inside and outside its loops.

    Reads the optimised HLO (``compiled.as_text()``), the program XLA runs after
    SPMD partitioning, and counts each collective instruction once per place it
    appears (not per execution): ``"loop"`` counts those in a while loop's body
    or condition (or a computation they call), which run once per iteration;
    ``"outside"`` the rest. An all-reduce of several arrays fused into one
    instruction counts once.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
        or its HLO text.

    Returns:
      ``{op: {"loop": count, "outside": count}}`` for each op in
      :data:`COLLECTIVES`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2))
      >>> counts = jaxaccum.count_collectives(
      ...     step.lower(jnp.ones(3), jnp.ones((4, 3))).compile())
      >>> counts["all-reduce"]  # one device: nothing to reduce
      {'loop': 0, 'outside': 0}
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)

    def callees(lines: list[str], kinds: tuple[str, ...]) -> set[str]:
        names = {
            name for kind, name in _CALLED.findall("\n".join(lines)) if kind in kinds
        }
        if "branch_computations" in kinds:
            for group in _BRANCHES.findall("\n".join(lines)):
                names.update(name.strip().lstrip("%") for name in group.split(","))
        return names

    all_kinds = (
        "body",
        "condition",
        "calls",
        "to_apply",
        "true_computation",
        "false_computation",
        "branch_computations",
    )
    in_loop: set[str] = set()
    pending = set().union(
        *(callees(lines, ("body", "condition")) for lines in bodies.values())
    )
    while pending:
        name = pending.pop()
        if name not in in_loop:
            in_loop.add(name)
            pending |= callees(bodies.get(name, []), all_kinds)
    counts = {op: {"loop": 0, "outside": 0} for op in COLLECTIVES}
    for name, lines in bodies.items():
        for line in lines:
            for op in _OP.findall(line):
                counts[op]["loop" if name in in_loop else "outside"] += 1
    return counts
