"""The window over a named axis on each device (``shard_value_and_grad``,
run under a ``shard_map`` without varying-axis types: each device's gradient
is its own, summed over the devices once, after the window): what it does
not take there, refused by name."""

from typing import Any

import jax

from jaxaccum._window._spec import WindowSpec
from jaxaccum._window._split import spec_names


def check_per_device(spec: WindowSpec) -> None:
    """Per device, an axis name the mesh does not bind and parameters
    replicated over the data axes (nothing to check without data axes).

    Raises:
      ValueError: naming the axis and the mesh's axes, or the parameter's
        position and its sharding.
    """
    if not spec.data_axes:
        return
    check_axis_name_is_free(spec.axis_name)
    for index, param_spec in enumerate(spec.sharding.param_specs):
        if any(set(spec_names(entry)) & set(spec.data_axes) for entry in param_spec):
            raise ValueError(
                f"Differentiated leaf {index} is sharded {param_spec} over the "
                f"data axes {spec.data_axes} (FSDP): with axis_name, "
                "shard_value_and_grad takes parameters replicated over the data "
                "axes for now. Replicate them (jax.sharding.reshard(leaf, P())), "
                "or use jaxaccum.value_and_grad(axis_name=...) under jit."
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
            f"{names}: the window's axis needs a name of its own (e.g. "
            "'window'); a collective that should meet across devices and "
            "micro-batches names both, as BatchNorm(axis_name=('data', "
            "'window'))."
        )
