"""What an accumulated function checks of each call: its arguments' count,
differentiable leaves, ``active_microbatches``, and the state ``fun`` returns."""

from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum._checks import check_scalar
from jaxaccum._types import PyTree
from jaxaccum._window._spec import WindowSpec


def pop_active_microbatches(kwargs: dict, options: WindowSpec) -> Any:
    """With ``masked``, the call's ``active_microbatches``, popped from
    ``kwargs`` (``fun`` never sees it); without, a refusal if it is passed."""
    if not options.masked:
        if "active_microbatches" in kwargs:
            raise TypeError(
                "active_microbatches was passed to a function built without "
                "masked=True: it would reach fun as a keyword argument (or "
                "be lost in its **kwargs) and every micro-batch would be "
                "computed. Build the function with masked=True to compute "
                "only the first active_microbatches micro-batches."
            )
        return None
    if "active_microbatches" not in kwargs:
        raise TypeError(
            "With masked=True, call the accumulated function with the keyword "
            "argument active_microbatches: how many of the window's "
            "micro-batches to compute (an int, traced under jit)."
        )
    return kwargs.pop("active_microbatches")


def check_active_microbatches(active: Any, num_microbatches: int) -> Any:
    """Checks ``active_microbatches`` against the window's ``N``. Returns
    None where it is concrete (and checked), else the traced flag that it is
    in range, which ``_packaging.package`` turns into NaN outputs when false."""
    check_scalar(
        "active_microbatches",
        active,
        integer=True,
        low=1,
        high=num_microbatches,
        hint="It counts the micro-batches of the window to compute: from 1 to "
        f"the window's N = {num_microbatches}.",
    )
    if not isinstance(active, jax.core.Tracer):
        return None
    return (active >= 1) & (active <= num_microbatches)


def check_arg_count(args: tuple, options: WindowSpec) -> None:
    needed = max(options.all_nums) + 1
    if len(args) < needed:
        used = ", ".join(
            f"{name}={nums}" for name, nums in options.roles.items() if nums
        )
        raise TypeError(
            f"The accumulated function needs at least {needed} positional "
            f"arguments ({used}), got {len(args)}."
        )


def check_differentiable_args(args: tuple, argnums: tuple[int, ...]) -> None:
    for num in argnums:
        check_differentiable(
            f"args[{num}]",
            args[num],
            "or pass it in an argument that is not in argnums.",
        )


def check_differentiable(label: str, tree: PyTree, fix: str) -> None:
    """Every leaf of the differentiated ``tree`` (named ``label``) is float
    or complex; else a TypeError naming the leaf, ending with ``fix``."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"Differentiated leaf {label}{jax.tree_util.keystr(path)} "
                f"has dtype {dtype}; gradients need float (or complex) "
                f"leaves. Cast it to a float dtype, {fix}"
            )


def check_state(state_vals: tuple, new_state: tuple, state_nums: tuple) -> None:
    """The state fun returns must have the structure, shapes and dtypes it got."""
    for num, before, after in zip(state_nums, state_vals, new_state, strict=True):
        old_tree: Any  # a PyTreeDef, which jaxlib's stubs leave unresolved
        new_tree: Any
        old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(before)
        new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(after)
        if old_tree != new_tree:
            raise ValueError(
                f"The new state fun returns for args[{num}] has structure "
                f"{new_tree}, but the state passed in has {old_tree}. Return the "
                "updated state with the same structure as the state argument."
            )
        for (path, old), (_, new) in zip(old_leaves, new_leaves, strict=True):
            old_spec = (jnp.shape(old), jnp.result_type(old))
            new_spec = (jnp.shape(new), jnp.result_type(new))
            if old_spec != new_spec:
                raise ValueError(
                    f"State leaf args[{num}]{jax.tree_util.keystr(path)} comes "
                    f"back from fun with shape {new_spec[0]} and dtype "
                    f"{new_spec[1]}, but went in with shape {old_spec[0]} and "
                    f"dtype {old_spec[1]}; it is carried from one micro-batch to "
                    "the next, so both must be the same."
                )
