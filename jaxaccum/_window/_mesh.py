"""The ``mesh=`` a sharded front end is given, checked the one way for every
one of them (shard_value_and_grad, shard_batch, cached_value_and_grad, the
pipeline): a ``jax.sharding.Mesh``, an ``AbstractMesh`` where it is the one
set with ``jax.set_mesh``, or None."""

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh


def check_mesh_type(mesh: Any, example: str) -> None:
    """``mesh`` is a ``Mesh``, an ``AbstractMesh`` or None (``example``: a
    ``jax.make_mesh`` call for the message).

    Raises:
      TypeError: naming what was passed and what to pass instead.
    """
    if mesh is None or isinstance(mesh, Mesh | AbstractMesh):
        return
    if isinstance(mesh, str):
        hint = f" A string names a mesh axis: pass data_axis={mesh!r} and a mesh."
    elif isinstance(mesh, list | tuple):
        hint = (
            " For a list of devices, build the mesh from them: "
            "jax.sharding.Mesh(np.array(devices), ('data',))."
        )
    else:
        hint = ""
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh (e.g. {example}), an AbstractMesh set "
        "with jax.set_mesh, or None for the mesh set with jax.set_mesh; got "
        f"{mesh!r} of type {type(mesh).__name__}.{hint}"
    )


def check_callable_mesh(mesh: Mesh | AbstractMesh | None) -> None:
    """A step given an AbstractMesh runs only where that mesh is set (it
    names axes and sizes, not devices).

    Raises:
      ValueError: for an AbstractMesh other than the one set with
        ``jax.set_mesh`` (or none set), saying what to pass.
    """
    if not isinstance(mesh, AbstractMesh):
        return
    current = jax.sharding.get_abstract_mesh()
    if current.empty or current != mesh:
        raise ValueError(
            f"mesh={mesh} is an AbstractMesh (axis names and sizes, no "
            f"devices) but not the one set with jax.set_mesh ({current}): pass "
            "the concrete Mesh, or call the step inside `with "
            "jax.set_mesh(mesh):` with the Mesh whose .abstract_mesh it is."
        )
