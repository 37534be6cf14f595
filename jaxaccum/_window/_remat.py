"""The checkpoint policy a window's ``remat`` option gives ``jax.checkpoint``:
the user's, except that a complex value is recomputed, never saved. JAX's
checkpoint rounds the values it saves with ``reduce_precision``, which takes
no complex dtype, so a policy that saved one failed on complex parameters or
activations; recomputing it gives the same values."""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jaxaccum._types import PyTree, Remat


def complex_equation(prim: Any, avals: tuple, params: dict) -> bool:
    """Whether an equation reads or writes a complex value."""
    try:
        out, _ = prim.abstract_eval(*avals, **params)
    except Exception:  # no abstract rule (or one that needs more): inputs only
        out = ()
    outs = out if prim.multiple_results else [out]
    return any(
        jnp.issubdtype(aval.dtype, jnp.complexfloating)
        for aval in (*avals, *outs)
        if hasattr(aval, "dtype")
    )


def real_only(policy: Callable[..., bool]) -> Callable[..., bool]:
    """``policy``, but an equation with a complex value is recomputed."""

    def saveable(prim: Any, *avals: PyTree, **params: Any) -> bool:
        return not complex_equation(prim, avals, params) and policy(
            prim, *avals, **params
        )

    return saveable


def checkpoint_policy(remat: Remat) -> Callable[..., bool] | None:
    """The policy for ``jax.checkpoint`` under ``remat``: ``None`` (save
    nothing) for ``True``, else the user's policy, complex values recomputed."""
    if remat is None or isinstance(remat, bool):
        return None
    return real_only(remat)
