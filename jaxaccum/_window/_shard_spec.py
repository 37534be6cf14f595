"""How a window is sharded: the options of :func:`jaxaccum.shard_value_and_grad`
(and of a pipeline's FSDP stages), apart from the window's own.

A window with no :class:`Sharding` runs on one device (or on whatever the
caller's jit shards); with one, it runs per device inside a ``shard_map`` over
``data_axes`` and reduces its sums over them once.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxaccum._types import SHARD_MODES, ShardMode

# What a caller may set (shard_value_and_grad's keywords); the front end sets
# data_axes, and each call its param_specs.
SHARD_KEYWORDS: tuple[str, ...] = ("param_gather", "grad_reduce", "gather_dtype")

# Why the unsharded front ends refuse the sharding keywords.
SHARD_OPTIONS: dict[str, str] = {
    name: "it is an option of jaxaccum.shard_value_and_grad (how parameters "
    "sharded over the data axes are gathered and gradients reduced)."
    for name in SHARD_KEYWORDS
}


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where a window's batch is split and how its FSDP parameters move.

    Attributes:
      data_axes: manual mesh axes the batch is split over: each device
        accumulates its rows, the sums reduced once after the loop.
      param_gather: when parameters sharded over ``data_axes`` are gathered.
      grad_reduce: when gradients are reduced over ``data_axes``.
      gather_dtype: dtype parameters are cast to before they are gathered.
      param_specs: per differentiated leaf (flattened), its ``PartitionSpec``
        outside the ``shard_map`` (``P()`` where unknown); set per call.
    """

    data_axes: tuple[str, ...] = ()
    param_gather: ShardMode = "auto"
    grad_reduce: ShardMode = "auto"
    gather_dtype: Any = None
    param_specs: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_gather", "grad_reduce"):
            if getattr(self, name) not in SHARD_MODES:
                raise ValueError(
                    f"{name} must be one of {SHARD_MODES}, got {getattr(self, name)!r}."
                )
        if self.gather_dtype is not None and not jnp.issubdtype(
            self.gather_dtype, jnp.floating
        ):
            raise ValueError(
                f"gather_dtype must be a floating dtype such as jnp.bfloat16 (or "
                f"None), got {self.gather_dtype!r}."
            )

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every field's name (the keywords a window's ``create`` routes here)."""
        return frozenset(field.name for field in dataclasses.fields(cls))
