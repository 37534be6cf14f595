"""FP8 metadata held by `MultiSteps` for a window: maxed over the window's
calls, checked against what ``init`` got."""

import jax
import jax.numpy as jnp

from jaxaccum._multisteps._state import MultiStepsState
from jaxaccum._precision import _metadata
from jaxaccum._types import PyTree

NO_METADATA = (
    "MultiSteps holds FP8 metadata only if init got it: "
    "opt.init(params, metadata=variables['_overwrite_with_gradient']) (or "
    "jaxaccum.flax.TrainState.create, which does so)."
)


def holds_no_metadata(state: MultiStepsState) -> bool:
    return isinstance(state.metadata, tuple) and not state.metadata


def window_metadata(metadata: PyTree) -> PyTree:
    """The state's running max of the metadata: float32 zeros like it."""
    return jax.tree.map(
        lambda leaf: jnp.zeros(jnp.shape(leaf), _metadata.physical_dtype(leaf.dtype)),
        metadata,
    )


def check_metadata(state: MultiStepsState, metadata: PyTree) -> PyTree:
    """``metadata`` passed to ``update``, checked against what ``init`` got."""
    held = state.metadata
    if metadata is None:
        if not holds_no_metadata(state):
            raise ValueError(
                "this MultiSteps state holds FP8 metadata (init got it): pass "
                "each call's new values, update(..., metadata=grads["
                "'_overwrite_with_gradient']), or build the state without it."
            )
        return None
    if holds_no_metadata(state):
        raise ValueError(NO_METADATA)
    check_layout("update's metadata", metadata, held)
    return metadata


def check_layout(name: str, metadata: PyTree, held: PyTree) -> None:
    """That ``metadata`` (``name``) has the leaves and shapes ``init`` got."""
    given, expected = layout(metadata), layout(held)
    if given != expected:
        raise ValueError(
            f"{name} is not shaped like the metadata init got: {given} against "
            f"{expected}. Pass the same collection every call "
            "(variables['_overwrite_with_gradient'])."
        )


def layout(tree: PyTree) -> list[tuple[str, tuple[int, ...]]]:
    """Each leaf's path (``keystr``) and shape."""
    return [
        (jax.tree_util.keystr(path), jnp.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def max_into_window(
    state: MultiStepsState, metadata: PyTree, should_skip: jax.Array
) -> PyTree:
    """The window's running max of the metadata after a call: reset lazily
    by a window's first accepted call (as ``acc_grads``), kept by a dropped
    one."""
    if metadata is None:
        return state.metadata
    window_start = state.mini_step == 0

    def into_window(acc: jax.Array, value: jax.Array) -> jax.Array:
        value = _metadata.physical(value).astype(acc.dtype)
        new = jnp.where(window_start, value, jnp.maximum(acc, value))
        return jnp.where(should_skip, acc, new)

    return jax.tree.map(into_window, state.metadata, metadata)


def next_metadata(
    state: MultiStepsState, current: PyTree, updated: jax.Array
) -> PyTree:
    """:meth:`MultiSteps.metadata`: the window's new values where ``updated``
    (the call that produced ``state`` emitted), else ``current``."""
    if holds_no_metadata(state):
        raise ValueError(NO_METADATA)
    check_layout("MultiSteps.metadata's current", current, state.metadata)
    return jax.tree.map(
        lambda new, old: _metadata.as_dtype(
            jnp.where(updated, new, _metadata.physical(old)), old.dtype
        ),
        state.metadata,
        current,
    )
