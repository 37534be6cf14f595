"""Collectives in a compiled program, inside its loops and outside, and its
convolutions' layouts (XLA:CPU runs a convolution fast only in its canonical
layout, ``b01f_01io->b01f``, which it gives convolutions outside loops but not
those inside)."""

import math
import re
from typing import Any, NamedTuple

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
"""The collective ops counted, by their HLO names (an async ``-start``
variant counts as its op)."""
# A computation's first line: unindented, ending in "{" (optimised HLO names
# carry a %, the HLO JAX emits does not).
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\b.*\{\s*$")
_CALLED = re.compile(
    r"(body|condition|calls|to_apply|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_INSTRUCTION = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_ITEM_BITS = {"pred": 8, "c64": 64, "c128": 128}


class Collective(NamedTuple):
    """One collective instruction of a compiled program.

    Attributes:
      op: one of :data:`COLLECTIVES`.
      in_loop: whether it is in a while loop (runs once per iteration).
      shapes: its result array types, e.g. ``("f32[256,128]",)``.
      group_size: devices in each of its replica groups (None if the HLO
        does not list them).
      bytes: the data it combines: its result's bytes, times the group size
        for a reduce-scatter (whose input is that many result-sized pieces).
        So an all-reduce, an all-gather and a reduce-scatter of one whole
        gradient each count that gradient's bytes once.
      dtypes: the element type of each result array, e.g. ``("f32",)``: the
        precision the collective runs in (a sum of ``bf16`` arrays rounds
        to 8 bits at each step).
      runs: how many times it runs per execution of the program: 1 outside
        loops, the product of its loops' trip counts inside them, None where
        the HLO does not state a loop's (``known_trip_count``).
    """

    op: str
    in_loop: bool
    shapes: tuple[str, ...]
    group_size: int | None
    bytes: int
    dtypes: tuple[str, ...]
    runs: int | None = 1


def count_collectives(compiled: Any) -> dict[str, dict[str, int]]:
    """Counts the collectives of a compiled step, inside and outside its loops.

    Reads the optimised HLO (``compiled.as_text()``), the program XLA runs after
    SPMD partitioning, and counts each collective instruction once per place it
    appears (not per execution): ``"loop"`` counts those in a while loop's body
    or condition (or a computation they call), which run once per iteration;
    ``"outside"`` the rest. An all-reduce of several arrays fused into one
    instruction counts once. :func:`collective_bytes` gives the bytes.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
        or its HLO text.

    Returns:
      ``{op: {"loop": count, "outside": count}}`` for each op in
      :data:`COLLECTIVES`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2))
      >>> counts = jaxaccum.testing.count_collectives(
      ...     step.lower(jnp.ones(3), jnp.ones((4, 3))).compile())
      >>> counts["all-reduce"]  # one device: nothing to reduce
      {'loop': 0, 'outside': 0}
    """
    return _tally(compiled, lambda collective: 1)


def collective_bytes(compiled: Any) -> dict[str, dict[str, int]]:
    """The bytes of a compiled step's collectives, inside and outside its loops.

    Like :func:`count_collectives`, per place in the program: bytes under
    ``"loop"`` move once per iteration, so a window of ``N`` micro-batches
    moves ``outside + N * loop`` (see :func:`window_bytes`). Each instruction
    counts :attr:`Collective.bytes`, the per-device data it combines, read
    from the HLO's shapes.

    Args:
      compiled: a compiled step, ``jax.jit(step).lower(*args).compile()``.

    Returns:
      ``{op: {"loop": bytes, "outside": bytes}}`` for each op in
      :data:`COLLECTIVES`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2))
      >>> jaxaccum.testing.collective_bytes(
      ...     step.lower(jnp.ones(3), jnp.ones((4, 3))).compile())["all-reduce"]
      {'loop': 0, 'outside': 0}
    """
    return _tally(compiled, lambda collective: collective.bytes)


def _tally(compiled: Any, amount: Any) -> dict[str, dict[str, int]]:
    """``amount(collective)`` summed per op, inside loops and outside."""
    totals = {op: {"loop": 0, "outside": 0} for op in COLLECTIVES}
    for collective in find_collectives(compiled):
        totals[collective.op]["loop" if collective.in_loop else "outside"] += amount(
            collective
        )
    return totals


def window_bytes(compiled: Any, num_microbatches: int | None = None) -> int:
    """Bytes all collectives of an accumulated step move in one window.

    Each collective counts as many times as it runs: once outside loops, and
    inside a loop as many times as the HLO says the loop runs
    (``known_trip_count``: ``N`` for the micro-batch loop, ``N / unroll``
    iterations of a body holding ``unroll`` copies, ``M R + S - 1`` ticks for
    a pipeline), which the compiled HLO states for ``lax.scan``.
    ``num_microbatches`` counts a loop whose trip count it does not state.

    Args:
      compiled: a compiled step, ``jax.jit(step).lower(*args).compile()``.
      num_microbatches: the iterations of a loop whose trip count the HLO
        does not state (e.g. a ``while_loop``); not needed otherwise.

    Returns:
      The bytes, per device, that the window's collectives move (an int).

    Raises:
      ValueError: if a loop with collectives states no trip count and
        ``num_microbatches`` is not given.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2))
      >>> compiled = step.lower(jnp.ones(3), jnp.ones((4, 3))).compile()
      >>> jaxaccum.testing.window_bytes(compiled)  # one device
      0
    """
    total = 0
    for collective in find_collectives(compiled):
        runs = collective.runs
        if runs is None:
            if num_microbatches is None:
                raise ValueError(
                    f"A {collective.op} runs in a loop whose trip count the "
                    "compiled HLO does not state; pass num_microbatches=, how "
                    "many times that loop runs."
                )
            runs = num_microbatches
        total += runs * collective.bytes
    return total


def find_collectives(compiled: Any) -> list[Collective]:
    """Every collective instruction of a compiled program.

    Reads the optimised HLO: each instruction of :data:`COLLECTIVES`, with its
    place (inside a loop or outside), result shapes, group size, bytes and
    dtypes.

    Args:
      compiled: a compiled program, ``jax.jit(f).lower(*args).compile()``.

    Returns:
      A list of :class:`Collective`, in the HLO's order.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum, jaxaccum.testing
      >>> step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2))
      >>> compiled = step.lower(jnp.ones(3), jnp.ones((4, 3))).compile()
      >>> jaxaccum.testing.find_collectives(compiled)  # one device: none
      []
    """
    bodies, in_loop = _program(compiled)
    runs = _runs(bodies)
    found = []
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.search(line)
            if match is None or not _OP.search(line):
                continue
            result, op, started = match.groups()
            arrays = _ARRAY.findall(result)
            if started and op in ("all-gather", "collective-permute"):
                arrays = arrays[len(arrays) // 2 :]  # (inputs, outputs)
            group_size = _group_size(line)
            size = sum(_array_bytes(dtype, dims) for dtype, dims in arrays)
            if op == "reduce-scatter" and group_size:
                size *= group_size
            shapes = tuple(f"{dtype}[{dims}]" for dtype, dims in arrays)
            dtypes = tuple(dtype for dtype, _ in arrays)
            found.append(
                Collective(
                    op, name in in_loop, shapes, group_size, size, dtypes, runs(name)
                )
            )
    return found


def _program(compiled: Any) -> tuple[dict[str, list[str]], set[str]]:
    """A compiled program's (or its HLO text's) computations, name ->
    instruction lines, and the names of those run inside a while loop."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    bodies = _computations(text)
    return bodies, _loop_computations(bodies)


def _computations(text: str) -> dict[str, list[str]]:
    """The HLO's computations: name -> instruction lines."""
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
    return bodies


def _loop_computations(bodies: dict[str, list[str]]) -> set[str]:
    """Names of the computations run inside a while loop."""

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
    return in_loop


_WHILE_BODY = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _runs(bodies: dict[str, list[str]]) -> Any:
    """``runs(name)``: how many times computation ``name`` runs per execution:
    the product of the trip counts of the while loops it is (transitively)
    the body of, None if one is not stated, 1 outside loops."""
    trips: dict[str, int | None] = {}  # loop body -> its trip count
    parent: dict[str, str] = {}  # computation -> a computation calling it
    for caller, lines in bodies.items():
        for line in lines:
            body = _WHILE_BODY.search(line)
            if body is not None:
                count = _TRIP_COUNT.search(line)
                trips[body.group(1)] = int(count.group(1)) if count else None
            for _, callee in _CALLED.findall(line):
                parent.setdefault(callee, caller)
            for group in _BRANCHES.findall(line):
                for callee in group.split(","):
                    parent.setdefault(callee.strip().lstrip("%"), caller)

    def runs(name: str) -> int | None:
        total: int | None = 1
        seen = set()
        while name in parent and name not in seen:
            seen.add(name)
            if name in trips:
                count = trips[name]
                total = None if count is None or total is None else total * count
            name = parent[name]
        return total

    return runs


def _group_size(line: str) -> int | None:
    iota = _IOTA_GROUPS.search(line)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = _LISTED_GROUPS.search(line)
    if listed:
        return len(listed.group(1).split(","))
    return None


def _array_bytes(dtype: str, dims: str) -> int:
    bits = _ITEM_BITS.get(dtype)
    if bits is None:
        digits = re.search(r"[0-9]+", dtype)
        bits = int(digits.group()) if digits else 8
    count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return count * bits // 8


_DIM_LABELS = re.compile(r"\sconvolution\(.*?dim_labels=([\w>\-]+)")
_CANONICAL = re.compile(r"^b\d+f_\d+io->b\d+f$")


class Convolution(NamedTuple):
    """One convolution instruction of a compiled program.

    Attributes:
      dim_labels: its operands' and result's layout, as XLA writes it.
      in_loop: whether it is in a while loop's body (runs once per iteration).
      canonical: whether the layout is the one XLA:CPU's fast kernel takes.
    """

    dim_labels: str
    in_loop: bool
    canonical: bool


def find_convolutions(compiled: Any) -> list[Convolution]:
    """Every convolution of a compiled program (``jax.jit(f).lower(...)
    .compile()``, or its HLO text), in the HLO's order."""
    bodies, in_loop = _program(compiled)
    found = []
    for name, lines in bodies.items():
        for line in lines:
            match = _DIM_LABELS.search(line)
            if match is not None:
                labels = match.group(1)
                found.append(
                    Convolution(labels, name in in_loop, bool(_CANONICAL.match(labels)))
                )
    return found


def slow_loop_convolutions(compiled: Any) -> int:
    """How many convolutions in a compiled program's loops are outside the
    layout of XLA:CPU's fast kernel (what that costs elsewhere is unmeasured)."""
    return sum(1 for c in find_convolutions(compiled) if c.in_loop and not c.canonical)
