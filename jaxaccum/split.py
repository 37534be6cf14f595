"""Batch -> micro-batches: strided, copy-free, validated.

Why strided: micro-batch ``k`` holds examples ``k, k + N, k + 2N, ...``. The
view ``(B, ...) -> (B // N, N, ...)`` is a free reshape, and micro-batch ``k`` is
column ``k`` of it. For a batch sharded over devices on axis 0, every device's
rows stay on that device for every micro-batch; a contiguous split would give
micro-batch ``k`` to a few devices only and make XLA move data between them.
Indexing the view inside the scan (rather than materialising a transposed
``(N, B // N, ...)`` copy first) keeps the batch from being copied at all.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _label(prefix: str, path: tuple) -> str:
    return prefix + jax.tree_util.keystr(path)


def _divisors(size: int) -> list[int]:
    return [d for d in range(1, size + 1) if size % d == 0]


def batch_size_of(batches: Sequence[tuple[str, Any]]) -> int:
    """Returns the common leading size of every leaf of the labelled batches.

    Args:
      batches: ``(label, pytree)`` pairs; the label prefixes leaf paths in errors.

    Raises:
      ValueError: if there are no leaves, a leaf is a scalar, or leading sizes
        differ.
    """
    sizes: dict[str, int] = {}
    for prefix, batch in batches:
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(
                    f"Batch leaf {_label(prefix, path)} is a scalar (shape ()); "
                    "every leaf of a batch argument needs a leading batch axis. "
                    "Pass per-batch constants as a non-batch argument instead."
                )
            sizes[_label(prefix, path)] = shape[0]
    if not sizes:
        raise ValueError(
            "The batch argument(s) contain no arrays; nothing to split into "
            "micro-batches. Check batch_argnums."
        )
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{name}: {size}" for name, size in sizes.items())
        raise ValueError(
            "All batch leaves must share the same leading (batch) size, got "
            f"{listing}. Make every batch leaf have the same first dimension, "
            "or move leaves without a batch axis to a non-batch argument."
        )
    return next(iter(sizes.values()))


def resolve_num_microbatches(
    batch_size: int,
    num_microbatches: int | None,
    microbatch_size: int | None,
    *,
    pad: bool = False,
) -> tuple[int, int]:
    """Returns ``(N, padded batch size)``, checking that N divides the batch.

    With ``pad`` a batch that N does not divide is padded up to the next
    multiple (``N * ceil(B / N)``, or ``microbatch_size * ceil(B / size)``).
    """
    if microbatch_size is not None:
        num = -(-batch_size // microbatch_size)
        if batch_size % microbatch_size and not pad:
            raise ValueError(
                f"Batch size {batch_size} is not divisible by "
                f"microbatch_size={microbatch_size}. Micro-batch sizes that "
                f"divide it: {_divisors(batch_size)}; or pass pad=True (with "
                "reduction='weighted' or 'sum') to pad the last micro-batches."
            )
        return num, num * microbatch_size
    assert num_microbatches is not None
    if batch_size % num_microbatches and not pad:
        raise ValueError(
            f"Batch size {batch_size} is not divisible by "
            f"num_microbatches={num_microbatches}, so the micro-batches would "
            f"have unequal sizes. Choose num_microbatches from "
            f"{_divisors(batch_size)}, change the batch size, or pass pad=True "
            "(with reduction='weighted' or 'sum') to pad with masked rows."
        )
    return num_microbatches, num_microbatches * -(-batch_size // num_microbatches)


def pad_batch(batch: Any, padded_size: int) -> Any:
    """Appends zero rows to every leaf so its leading size is ``padded_size``."""

    def pad(x):
        missing = padded_size - x.shape[0]
        if not missing:
            return x
        return jnp.pad(x, [(0, missing)] + [(0, 0)] * (x.ndim - 1))

    return jax.tree.map(pad, batch)


def check_count(name: str, value: Any) -> None:
    """Checks that a micro-batch count or size is a positive Python int."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"{name} must be a positive Python int, got {value!r} of type "
            f"{type(value).__name__}. It fixes the compiled loop's length, so "
            "it cannot be a traced or float value."
        )
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")


def strided_view(batch: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf ``(B, ...)`` to the free view ``(B // N, N, ...)``."""
    return jax.tree.map(
        lambda x: jnp.reshape(
            x, (x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:])
        ),
        batch,
    )


def take_microbatch(view: Any, index: jax.Array) -> Any:
    """Micro-batch ``index`` (examples ``index, index + N, ...``) of a view."""
    return jax.tree.map(
        lambda x: lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False), view
    )


def split_batch(batch: Any, num_microbatches: int) -> Any:
    """Splits a batch into ``num_microbatches`` strided micro-batches.

    Micro-batch ``k`` holds examples ``k, k + N, k + 2N, ...``: the same split
    that :func:`jaxaccum.value_and_grad` uses, for users who write their own
    loop. Unlike ``value_and_grad`` (which indexes a free view inside its scan),
    this materialises the stacked ``(N, B // N, ...)`` arrays.

    Args:
      batch: a pytree of arrays sharing a leading batch axis of size ``B``.
      num_microbatches: ``N``, a positive int dividing ``B``.

    Returns:
      A pytree like ``batch`` whose leaves have shape ``(N, B // N, ...)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> jaxaccum.split_batch(jnp.arange(6), 2)
      Array([[0, 2, 4],
             [1, 3, 5]], dtype=int32)
    """
    check_count("num_microbatches", num_microbatches)
    size = batch_size_of([("batch", batch)])
    resolve_num_microbatches(size, num_microbatches, None)
    return jax.tree.map(
        lambda x: jnp.swapaxes(x, 0, 1), strided_view(batch, num_microbatches)
    )
