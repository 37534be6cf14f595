"""A device's ``R`` stages as its loop reads them: each op reads its
chunk's parameters at a static index inside a ``lax.switch`` branch, never
a dynamic slice at the tick's chunk (XLA:CPU copies a dynamic slice that
feeds a dot, every tick). In model order the step has relaid the stages
out (a copy already) and they are split into ``R`` arrays before the loop,
each read whole. In device order they are the parameters as given and
each branch slices its row of the stack: no copy of them is held through
the loop (on XLA:CPU the static slice is a copy of the one chunk, made and
freed in the op)."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax


class Chunks(NamedTuple):
    """Where each of a device's chunks is read from.

    Attributes:
      trees: per chunk, the stacked parameters its row is read from.
      rows: per chunk, its row in them (static).
    """

    trees: tuple
    rows: tuple[int, ...]


def split(parts: tuple) -> Chunks:
    """Chunks that are each their own ``(1, ...)`` arrays (split, or
    relaid out, before the loop)."""
    return Chunks(tuple(parts), (0,) * len(parts))


def held(stack: Any, repeats: int) -> Chunks:
    """Chunks read in place from the device's ``(R, ...)`` stack."""
    return Chunks((stack,) * repeats, tuple(range(repeats)))


def read(chunks: Chunks, chunk: int) -> Any:
    """Chunk ``chunk``'s ``(1, ...)`` parameters."""
    row = chunks.rows[chunk]
    return jax.tree.map(lambda p: p[row : row + 1], chunks.trees[chunk])


def on_chunk(chunks: Chunks, index: Any, fn: Callable[..., Any], *operands: Any) -> Any:
    """``fn(own, *operands)`` on chunk ``index``'s parameters: a
    ``lax.switch`` whose branch ``c`` reads chunk ``c`` at its static row."""

    def branch(c: int) -> Callable[..., Any]:
        return lambda trees, *ops: fn(read(chunks._replace(trees=trees), c), *ops)

    branches = [branch(c) for c in range(len(chunks.rows))]
    return lax.switch(index, branches, chunks.trees, *operands)
