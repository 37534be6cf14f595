"""What :func:`jaxaccum.testing.diagnose` measures of a loss to find the cause:
how its gradient moves with the keys, the micro-batches' weights, and whether
examples interact."""

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jaxaccum._diagnose import _compare
from jaxaccum._precision import _metadata
from jaxaccum._types import Fun, PyTree
from jaxaccum._value_and_grad import make_accumulated
from jaxaccum._window import _split
from jaxaccum._window._spec import WindowSpec

# A cause is named when its model of the error leaves a residual under this
# fraction of the error: float32 rounding leaves ~1e-6, a wrong model ~1.
EXPLAINED = 0.05


def flat_gradients(tree: PyTree) -> np.ndarray:
    """The gradient leaves of ``tree`` in one float64 vector (FP8 metadata,
    not a gradient, left out)."""
    return np.asarray(ravel_pytree(_metadata.gradient_leaves(tree))[0], np.float64)


def least_squares_scale(actual: np.ndarray, reference: np.ndarray) -> float:
    norm = float(reference @ reference)
    return float(actual @ reference) / norm if norm else float("nan")


def relative_change(new: PyTree, old: PyTree) -> float:
    new, old = flat_gradients(new), flat_gradients(old)
    return float(np.max(np.abs(new - old), initial=0.0)) / max(
        float(np.max(np.abs(old), initial=0.0)), float(np.finfo(np.float32).tiny)
    )


def key_sensitivity(
    fun: Fun, args: tuple, reference: tuple, options: WindowSpec
) -> float:
    """Relative change of the full-batch gradient when every key is changed."""
    other_args = list(args)
    for num in options.key_nums:
        other_args[num] = jax.tree.map(
            lambda key: jax.random.fold_in(key, 1), args[num]
        )
    other = _compare.reference(fun, tuple(other_args), options)
    return relative_change(other[1], reference[1])


def microbatch_weights(
    fun: Fun,
    args: tuple,
    num: int,
    reference_grads: np.ndarray,
    error: float,
    options: WindowSpec,
) -> np.ndarray | None:
    """Weights ``a`` with ``full-batch grad = sum_k a_k g_k``, relative to their
    mean, if the micro-batch gradients ``g_k`` determine them and they explain
    the error; else None. Each ``g_k`` is micro-batch ``k``'s alone (with
    ``axis_name``, the axis's one member: its own statistics)."""
    batch_vals = tuple(args[i] for i in options.batch_nums)
    batch_size = _split.batch_size_of([("batch", batch_vals)])
    padded_size = _split.resolve_num_microbatches(
        batch_size, num, None, pad=options.pad
    ).padded_size
    batch = _split.strided_batch(_split.pad_batch(batch_vals, padded_size), num)
    mask_view = _split.strided_view(jnp.arange(padded_size) < batch_size, num)
    keys = [
        jax.tree.map(lambda key: jax.random.split(key, num), args[i])
        for i in options.key_nums
    ]
    micro_fun = fun
    if options.pad:
        # The micro-batch's mask rides as an extra last positional argument.
        def micro_fun(*call_args, **call_kwargs):
            return fun(*call_args[:-1], **call_kwargs, example_mask=call_args[-1])

    alone = dataclasses.replace(_compare.reference_options(options), pad=False)
    micro_value_and_grad = jax.jit(
        make_accumulated(_compare.on_whole_batch(micro_fun, options), alone)
    )
    call_args = list(args) + ([None] if options.pad else [])
    columns = []
    for index in range(num):
        micro_batch = batch.microbatch(index)
        for num_arg, value in zip(options.batch_nums, micro_batch, strict=True):
            call_args[num_arg] = value
        if num > 1:
            for num_arg, key in zip(options.key_nums, keys, strict=True):
                call_args[num_arg] = jax.tree.map(operator.itemgetter(index), key)
        if options.pad:
            call_args[-1] = mask_view[:, index]
        result = micro_value_and_grad(*call_args)
        if options.state_nums:
            result, new_state = result
            if isinstance(options.state_argnums, int):
                new_state = (new_state,)
            for num_arg, value in zip(options.state_nums, new_state, strict=True):
                call_args[num_arg] = value
        columns.append(flat_gradients(result[1]))
    matrix = np.stack(columns, axis=1)
    weights, _, rank, _ = np.linalg.lstsq(matrix, reference_grads, rcond=None)
    residual = np.linalg.norm(matrix @ weights - reference_grads)
    if rank < num or residual > EXPLAINED * error or not np.mean(weights):
        return None
    return weights / np.mean(weights)


def example_interaction(fun: Fun, args: tuple, options: WindowSpec) -> float | None:
    """How much moving the last example changes the other examples' gradients
    (on the full batch, with ``axis_name`` the axis's one member)."""
    leaves, treedef = jax.tree.flatten(tuple(args[i] for i in options.batch_nums))
    floats = [
        index
        for index, leaf in enumerate(leaves)
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    ]
    batch_size = np.shape(leaves[0])[0]
    if not floats or batch_size < 2:
        return None
    whole = _compare.on_whole_batch(fun, options)

    def loss(float_leaves):
        batch_leaves = list(leaves)
        for index, leaf in zip(floats, float_leaves, strict=True):
            batch_leaves[index] = leaf
        call_args = list(args)
        for num_arg, value in zip(
            options.batch_nums, jax.tree.unflatten(treedef, batch_leaves), strict=True
        ):
            call_args[num_arg] = value
        extra = {"example_mask": jnp.ones(batch_size, bool)} if options.pad else {}
        out = whole(*call_args, **extra)
        if options.state_nums:
            out = out[0]
        if options.has_aux:
            out = out[0]
        if options.reduction == "weighted":
            out = out[0]
        return out

    def moved(index, leaf):
        leaf = jnp.asarray(leaf)
        spread = jnp.std(leaf)
        spread = jnp.where(spread > 0, spread, 1.0)
        noise = jax.random.normal(jax.random.key(index), leaf.shape[1:])
        return leaf.at[-1].add((spread * noise).astype(leaf.dtype))

    grad = jax.jit(jax.grad(loss))
    float_leaves = [leaves[index] for index in floats]
    before = grad(float_leaves)
    after = grad([moved(index, leaf) for index, leaf in enumerate(float_leaves)])
    # Only the examples that were not moved: their gradients must not change.
    return relative_change(
        [leaf[:-1] for leaf in after], [leaf[:-1] for leaf in before]
    )
