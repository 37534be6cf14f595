"""The window over a named axis on each device (``shard_value_and_grad``,
run under a ``shard_map`` without varying-axis types: each device's gradient
is its own, reduced over the devices once, after the window): its axis name,
and its parameters sharded over the data axes (FSDP), gathered once before
the window and their gradients reduce-scattered once after it."""

from typing import Any

import jax
from jax import lax

from jaxaccum._window._fsdp import ShardPlan, shard_plan
from jaxaccum._window._spec import WindowSpec


def check_per_device(spec: WindowSpec) -> None:
    """An axis name that nothing around the window binds (the caller's
    ``shard_map`` or ``vmap``) and, per device, that the mesh does not bind;
    or, per device, one of the data axes (the window joins it).

    Raises:
      ValueError: naming the axis and what binds it.
    """
    if joins(spec):
        return
    check_axis_name_is_unbound(spec.axis_name)
    if spec.data_axes:
        check_axis_name_is_free(spec.axis_name)


def check_axis_name_is_unbound(axis_name: Any) -> None:
    """The window's axis does not shadow one the caller binds.

    Raises:
      ValueError: naming the axis and its size where the caller's
        ``shard_map`` (or ``vmap``, ``pmap``) binds it.
    """
    try:
        bound = lax.axis_size(axis_name)
    except NameError:  # unbound: the window binds it
        return
    raise ValueError(
        f"axis_name={axis_name!r} is already bound around the window (by your "
        f"shard_map, vmap or pmap, with {bound} members): the window would "
        "bind it again over its micro-batches and hide it, so a collective "
        "over it would meet one device's micro-batches only. Give the window "
        "an axis of its own (axis_name='window') and name both where they "
        "should meet, as BatchNorm(axis_name=('data', 'window')); or run the "
        "window with jaxaccum.shard_value_and_grad(..., axis_name=data axis), "
        "which joins the devices and the micro-batches into one axis."
    )


def joins(spec: WindowSpec) -> bool:
    """Whether the window joins a data axis: per device, ``axis_name`` is
    one of them (a model that hardcodes its device axis's name, as Flax's
    ImageNet ResNet's ``BatchNorm(axis_name='batch')``)."""
    return spec.axis_name in spec.data_axes


def window_shards(spec: WindowSpec) -> ShardPlan | None:
    """Per device with parameters sharded over the data axes, the plan that
    gathers them once before the window and reduce-scatters their gradients
    once after it (None otherwise): the window's collectives need every
    micro-batch's values of one parameter, so it is not gathered per
    micro-batch."""
    plan = shard_plan(spec.resharded(param_gather="window", grad_reduce="window"))
    if plan is None or all(dim is None for dim in plan.dims):
        return None
    return plan


def check_modes(spec: WindowSpec) -> None:
    """The FSDP modes a window over a named axis takes (``"auto"`` or
    ``"window"``), checked where ``fun`` has a collective over it.

    Raises:
      ValueError: for ``param_gather`` or ``grad_reduce`` ``"microbatch"``.
    """
    sharding = spec.sharding
    for name in ("param_gather", "grad_reduce"):
        if getattr(sharding, name) == "microbatch":
            raise ValueError(
                f"{name}='microbatch' with axis_name={spec.axis_name!r}: the "
                "window over a named axis differentiates all its micro-batches "
                "at once, so a parameter sharded over the data axes is gathered "
                "once before the window and its gradient reduce-scattered once "
                f"after it. Pass {name}='auto' or 'window'."
            )


def check_axis_name_is_free(axis_name: Any) -> None:
    """The window's axis is not one the mesh already binds.

    Raises:
      ValueError: naming the axis and the mesh's axes.
    """
    names = jax.sharding.get_abstract_mesh().axis_names
    if axis_name in names:
        raise ValueError(
            f"axis_name={axis_name!r} is an axis of the mesh, whose axes are "
            f"{names}, but not a data axis: the window's axis needs a name of "
            "its own (e.g. 'window'), or the data axis's, which it then joins; "
            "a collective that should meet across devices and micro-batches "
            "names both, as BatchNorm(axis_name=('data', 'window'))."
        )
