"""One micro-batch: the window's arguments by role, and a micro-batch's value
and gradient, differentiated at its share of the window."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum._precision._loss_scale import scale_loss
from jaxaccum._types import Fun, PyTree
from jaxaccum._window import _split
from jaxaccum._window._fsdp import shard_plan
from jaxaccum._window._micro_result import (
    MicroOut,
    MicroResult,
    aux_pair,
    checked_loss,
    microbatch_share,
    share_dtype,
    weighted_pair,
)
from jaxaccum._window._remat import checkpoint_policy
from jaxaccum._window._spec import WindowSpec


class Inputs(NamedTuple):
    """The window's arguments by role (each a tuple in argument order), the
    call's ``active_microbatches`` and loss scale (float32) where given."""

    diff: tuple
    batch: tuple
    keys: tuple
    state: tuple
    example_mask: jax.Array | None
    active: jax.Array | None = None
    loss_scale: jax.Array | None = None


def window_inputs(
    args: tuple, options: WindowSpec, split: _split.Split, active: Any = None
) -> Inputs:
    """The window's arguments by role; the batch padded, keys per device."""
    diff = tuple(args[i] for i in options.diff_nums)
    keys = tuple(args[i] for i in options.key_nums)
    shards = shard_plan(options)
    if shards is not None:
        keys = fold_device_index(keys, options.data_axes)
        diff = shards.gather(shards.varying(diff), in_window=True)
    batch = _split.pad_batch(
        tuple(args[i] for i in options.batch_nums), split.padded_size
    )
    example_mask = None
    if options.pad:
        example_mask = jnp.arange(split.padded_size) < split.batch_size
    state = tuple(args[i] for i in options.state_nums)
    return Inputs(diff, batch, keys, state, example_mask, active)


def micro_value_and_grad(
    fun: Fun,
    args: tuple,
    kwargs: dict,
    options: WindowSpec,
    loss_scale: jax.Array | None = None,
) -> Callable[..., MicroResult]:
    """The value and gradient of one micro-batch, as a :class:`MicroResult`.

    Called as ``micro(diff, batch, keys, state, example_mask, num_means)``,
    the first five each a tuple of that role's arguments, ``num_means`` the
    window's micro-batches over every device; the other arguments of ``fun``
    are closed over. The loss is differentiated at its share of the window
    (:func:`microbatch_share`) and, with ``loss_scale``, scaled by it: the
    gradients come out so, the value as ``fun`` returned it.
    """
    roles = (
        options.diff_nums,
        options.batch_nums,
        options.key_nums,
        options.state_nums,
    )

    def micro_loss(*role_vals_mask_and_count):
        *role_vals, example_mask, num_means = role_vals_mask_and_count
        call_args = list(args)
        for nums, vals in zip(roles, role_vals, strict=True):
            for i, val in zip(nums, vals, strict=True):
                call_args[i] = val
        extra = {"example_mask": example_mask} if options.pad else {}
        out = fun(*call_args, **kwargs, **extra)
        new_state = ()
        if options.state_nums:
            out, new_state = out
            if isinstance(options.state_argnums, int):
                new_state = (new_state,)
        loss, aux = aux_pair(out, "fun") if options.has_aux else (out, ())
        weight = ()
        if options.reduction == "weighted":
            loss, weight = weighted_pair(loss, "fun")
        loss = checked_loss(loss, "fun")
        share = microbatch_share(options, num_means, weight, share_dtype(loss))
        differentiated = loss * share.astype(jnp.result_type(loss))
        if loss_scale is not None:
            differentiated = scale_loss(differentiated, loss_scale)
        return differentiated, (loss, share, MicroOut(weight, aux, tuple(new_state)))

    if options.remat:
        micro_loss = jax.checkpoint(micro_loss, policy=checkpoint_policy(options.remat))
    value_and_grad_fun = jax.value_and_grad(micro_loss, has_aux=True)

    def micro(diff, batch, keys, state, example_mask, num_means) -> MicroResult:
        # Named so that a profiler trace shows where a window's time goes.
        with jax.named_scope("jaxaccum_microbatch"):
            (_, (value, share, out)), grads = value_and_grad_fun(
                diff, batch, keys, state, example_mask, num_means
            )
        return MicroResult(value, out, grads, share)

    return micro


def microbatch_keys(keys: PyTree, num_microbatches: int) -> PyTree:
    """Each key of ``keys`` as ``num_microbatches`` keys stacked on axis 0,
    micro-batch ``k``'s at ``k``, as the core's scan draws them (the key
    itself, unsplit, for one micro-batch, as ``jax.value_and_grad`` sees it)."""
    if num_microbatches > 1:
        return jax.tree.map(lambda key: jax.random.split(key, num_microbatches), keys)
    return jax.tree.map(lambda key: jnp.expand_dims(key, 0), keys)


def fold_device_index(key_vals: tuple, data_axes: tuple[str, ...]) -> tuple:
    """Keys folded with the device's index, so that devices draw independent
    randomness for their rows."""
    device_index = lax.axis_index(data_axes)
    return jax.tree.map(lambda key: jax.random.fold_in(key, device_index), key_vals)


def gathered(diff: tuple, options: WindowSpec, index: Any = None) -> tuple:
    """The parameters micro-batch ``index`` sees: those sharded over the data
    axes and gathered per micro-batch are gathered here, inside the loop."""
    shards = shard_plan(options, index)
    return diff if shards is None else shards.gather(diff, in_window=False)


def window_num_means(options: WindowSpec, num_microbatches: Any) -> Any:
    """The window's micro-batches over every device (a mean divides by it)."""
    if options.data_axes:
        return num_microbatches * lax.axis_size(options.data_axes)
    return num_microbatches
