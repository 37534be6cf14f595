"""Proof in your own tests: accumulated gradients equal the large-batch one.

``assert_grads_match_full_batch`` (built on chex), ``diagnose`` (why they
differ when they do) and ``count_collectives`` / ``collective_bytes`` /
``find_collectives`` (what a compiled step communicates, and how much).
Imported on first use of ``jaxaccum.testing``, so ``import jaxaccum`` in a
training step does not load chex.
"""

import chex
from typing_extensions import Unpack

from jaxaccum._diagnose._compare import (
    accumulated_and_reference,
    leaf_errors,
    metadata_paths,
)
from jaxaccum._diagnose._diagnose import diagnose
from jaxaccum._diagnose._diagnosis import Cause, Diagnosis, LeafError
from jaxaccum._plan._hlo import (
    COLLECTIVES,
    Collective,
    collective_bytes,
    count_collectives,
    find_collectives,
    window_bytes,
)
from jaxaccum._types import CompareKwargs, Fun, PyTree
from jaxaccum._window._spec import COMPARE_REFUSED, WindowSpec

__all__ = [
    "COLLECTIVES",
    "Cause",
    "Collective",
    "Diagnosis",
    "LeafError",
    "assert_grads_match_full_batch",
    "collective_bytes",
    "count_collectives",
    "diagnose",
    "find_collectives",
    "leaf_errors",
    "window_bytes",
]


def assert_grads_match_full_batch(
    fun: Fun,
    *args: PyTree,
    num_microbatches: int | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[CompareKwargs],
) -> None:
    """Asserts that accumulated value and gradients equal the full-batch ones.

    Computes ``jaxaccum.value_and_grad(fun, num_microbatches, **kwargs)`` and the
    same with one micro-batch (exactly ``jax.value_and_grad`` on the whole
    batch; with ``axis_name``, see below), both under ``jax.jit``, and
    compares values and gradients with
    ``chex.assert_trees_all_close``. Works for every reduction (``"weighted"``
    included) and with ``pad``, ``key_argnums`` and ``state_argnums``; with
    ``masked=True`` the window runs with every micro-batch active
    (``active_microbatches=N``); aux outputs, new state and reports are not
    compared. FP8 metadata (Flax's
    ``_overwrite_with_gradient`` collection) is compared as values: the
    window's is the max of its micro-batches', which is the full batch's.

    With ``axis_name``, ``fun`` may have collectives over the window
    (``lax.pmean`` for BatchNorm's statistics, ``lax.all_gather`` of in-batch
    negatives, ``lax.psum`` of counts): the window is
    ``jaxaccum.value_and_grad(fun, N, axis_name=...)`` and the reference
    the full batch as the axis's one member,
    ``jax.vmap(fun, axis_name=axis_name, axis_size=1)`` of the whole call
    (a ``pmean`` over the axis is the identity, ``axis_index`` is 0), which
    is the big batch of the [Flax guide](../guides/flax.md#batchnorm).

    Args:
      fun: the loss function, as for :func:`jaxaccum.value_and_grad`.
      *args: its positional arguments, batch included.
      num_microbatches: ``N``; or pass ``microbatch_size`` in the kwargs.
      rtol: relative tolerance. The result and the reference are the same
        float32 sums in another order, and rounding differs between CPUs: two
        orders of a sum of ``n`` terms differ by at most ``2 n 2**-24``
        relative where the terms do not cancel (Higham, 4.2). The default,
        1e-5, covers that for ``n`` up to about 80 terms per sum; pass
        ``2 * batch_size * 2**-24`` for a bound that holds for any batch.
      atol: absolute tolerance, for coordinates whose terms cancel: the bound
        above times the mean magnitude of the per-example gradients.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``argnums``, ``batch_argnums``, ``reduction``,
        ``axis_name``: the window's axis, bound on both sides as above, ...).

    Raises:
      AssertionError: naming the worst leaf, its max absolute and relative
        error and ``N``, followed by chex's report.
      NameError: ``fun`` has a collective over an axis no ``axis_name``
        binds (a note says to pass it).

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(jnp.tanh(x @ w))
      >>> jaxaccum.testing.assert_grads_match_full_batch(
      ...     loss, jnp.ones(3), jnp.ones((8, 3)), num_microbatches=4)
    """
    options = WindowSpec.create(
        "assert_grads_match_full_batch",
        num_microbatches,
        value_and_grad_kwargs,
        CompareKwargs,
        refused=COMPARE_REFUSED,
    )
    accumulated, reference = accumulated_and_reference(fun, args, options)
    try:
        chex.assert_trees_all_close(accumulated, reference, rtol=rtol, atol=atol)
    except AssertionError as error:
        split = (
            f"num_microbatches={num_microbatches}"
            if num_microbatches is not None
            else f"microbatch_size={options.microbatch_size}"
        )
        errors = leaf_errors(
            {"value": accumulated[0], "grads": accumulated[1]},
            {"value": reference[0], "grads": reference[1]},
        )
        metadata = metadata_paths({"grads": reference[1]})
        lines = [
            f"  {path}: max abs error {abs_err:.3g}, relative error {rel_err:.3g}"
            + (
                " (FP8 metadata: the max over micro-batches)"
                if path in metadata
                else ""
            )
            for path, abs_err, rel_err in sorted(errors, key=lambda e: -e[1])
            if abs_err > atol
        ]
        raise AssertionError(
            f"Accumulated result with {split} does not match the full batch "
            f"(rtol={rtol}, atol={atol}). Leaves that differ:\n"
            + "\n".join(lines)
            + f"\n{error}"
        ) from None
