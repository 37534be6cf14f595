"""The Flax front ends' checks: :func:`jaxaccum.testing.diagnose` for a Linen
or an NNX loss, its roles (parameters, state, batch) set by the front end."""

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from flax import nnx
from typing_extensions import Unpack

from jaxaccum._flax._linen import (
    collection_names,
    holds_metadata,
    linen_loss,
    linen_split,
)
from jaxaccum._flax._nnx import check_no_graph_nodes, nnx_loss
from jaxaccum._types import Batch, FlaxCompareKwargs, Fun, Params, PyTree
from jaxaccum._window._spec import COMPARE_REFUSED, WindowSpec

if TYPE_CHECKING:
    from jaxaccum._diagnose._diagnosis import Diagnosis


ROLES = ("argnums", "batch_argnums", "key_argnums", "state_argnums")


def check_kwargs(helper: str, value_and_grad_kwargs: Collection[str]) -> None:
    """The Flax checks differentiate the parameters, split the batch (the
    second argument) and carry the model's state: they set those roles, and
    compare unscaled, unsharded windows."""
    WindowSpec.check_keywords(
        helper,
        value_and_grad_kwargs,
        FlaxCompareKwargs,
        fixed=ROLES,
        refused=COMPARE_REFUSED,
    )


def linen_diagnose(
    fun: Fun,
    variables: Params,
    batch: Batch,
    *args: PyTree,
    num_microbatches: int | None = None,
    mutable: str | Sequence[str] = (),
    rngs: Any = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[FlaxCompareKwargs],
) -> "Diagnosis":
    """:func:`jaxaccum.testing.diagnose` for a loss of :func:`linen_value_and_grad`.

    Compares :func:`jaxaccum.flax.linen_value_and_grad` with ``N`` micro-batches
    and with one (the full batch), and names why they differ, e.g. BatchNorm.

    Args:
      fun: as for :func:`jaxaccum.flax.linen_value_and_grad`.
      variables: the model's variables.
      batch: the batch.
      *args: more arguments of ``fun``, passed unchanged.
      num_microbatches: ``N``; or pass ``microbatch_size``.
      mutable: the collections ``fun`` updates.
      rngs: PRNG keys for ``apply``, split per micro-batch.
      rtol: relative tolerance.
      atol: absolute tolerance.
      **value_and_grad_kwargs: other :func:`jaxaccum.value_and_grad`
        arguments (``has_aux``, ``reduction``, ...).

    Returns:
      A :class:`jaxaccum.testing.Diagnosis`; ``print`` it for the report.

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import jaxaccum.flax
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False), nn.Dense(1)])
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> variables = model.init(jax.random.key(1), x)
      >>> def loss_fn(variables, x):
      ...     out, updates = model.apply(variables, x, mutable="batch_stats")
      ...     return jnp.mean(out**2), updates
      >>> diagnosis = jaxaccum.flax.linen_diagnose(
      ...     loss_fn, variables, x, num_microbatches=2, mutable="batch_stats")
      >>> [cause.kind for cause in diagnosis.causes]
      ['batch_dependent']
    """
    # loads chex, as jaxaccum.testing does
    from jaxaccum._diagnose._diagnose import diagnose

    check_kwargs("linen_diagnose", value_and_grad_kwargs)
    collections = collection_names(mutable)
    params, state, others = linen_split(variables, collections)
    has_aux = value_and_grad_kwargs.get("has_aux", False)
    fp8 = holds_metadata(params)
    return diagnose(
        linen_loss(fun, collections, has_aux, fp8),
        params,
        state,
        batch,
        rngs,
        others,
        *args,
        num_microbatches=num_microbatches,
        rtol=rtol,
        atol=atol,
        argnums=0,
        batch_argnums=2,
        key_argnums=() if rngs is None else 3,
        state_argnums=1 if collections else (),
        **value_and_grad_kwargs,
    )


def nnx_diagnose(
    fun: Fun,
    model: Params,
    batch: Batch,
    *args: PyTree,
    num_microbatches: int | None = None,
    wrt: Any = nnx.Param,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    **value_and_grad_kwargs: Unpack[FlaxCompareKwargs],
) -> "Diagnosis":
    """:func:`jaxaccum.testing.diagnose` for a loss of :func:`nnx_value_and_grad`.

    Compares :func:`jaxaccum.flax.nnx_value_and_grad` with ``N`` micro-batches
    and with one (the full batch), and names why they differ. The model is not
    changed.

    Args:
      fun: as for :func:`jaxaccum.flax.nnx_value_and_grad`.
      model: the ``nnx.Module``.
      batch: the batch.
      *args: more arguments of ``fun``, passed unchanged.
      num_microbatches: ``N``; or pass ``microbatch_size``.
      wrt: an ``nnx`` filter of the Variables to differentiate.
      rtol: relative tolerance.
      atol: absolute tolerance.
      **value_and_grad_kwargs: other :func:`jaxaccum.value_and_grad`
        arguments (``has_aux``, ``reduction``, ...).

    Returns:
      A :class:`jaxaccum.testing.Diagnosis`; ``print`` it for the report.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxaccum.flax
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                        nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
      >>> x = jax.random.normal(jax.random.key(0), (8, 3))
      >>> def loss_fn(model, x):
      ...     return jnp.mean(model(x) ** 2)
      >>> jaxaccum.flax.nnx_diagnose(loss_fn, model, x, num_microbatches=4).matches
      True
    """
    # loads chex, as jaxaccum.testing does
    from jaxaccum._diagnose._diagnose import diagnose

    check_kwargs("nnx_diagnose", value_and_grad_kwargs)
    check_no_graph_nodes(args)
    loss, params, state = nnx_loss(fun, model, wrt)
    return diagnose(
        loss,
        params,
        state,
        batch,
        *args,
        num_microbatches=num_microbatches,
        rtol=rtol,
        atol=atol,
        argnums=0,
        batch_argnums=2,
        state_argnums=1,
        **value_and_grad_kwargs,
    )
