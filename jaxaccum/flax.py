"""Flax integration: accumulate Linen and NNX models, their state carried in order.

Models carry state besides parameters: BatchNorm statistics (Linen's
``batch_stats`` collection, NNX's ``nnx.BatchStat``) and, in NNX, the RNG
streams' counters. These helpers build on :func:`jaxaccum.value_and_grad`: the
parameters are differentiated, the state is carried through the micro-batches
in order (micro-batch ``k`` sees the state micro-batch ``k - 1`` left), so after
a window it is what ``N`` sequential forward passes in training mode leave,
which is what PyTorch and Keras do when they accumulate.

BatchNorm cannot match the big batch. In training mode it normalizes each
example with the mean and variance of the batch it is in, so an example's
output, and the gradient, depend on the other examples: with micro-batches the
statistics come from ``B / N`` examples instead of ``B``, and no single-pass
accumulation can give the big-batch gradient (a multi-pass scheme can, with
one forward sweep over the micro-batches per BatchNorm layer for the
full-batch statistics before the gradient pass; :func:`linen_diagnose`,
:func:`nnx_diagnose` and ``jaxaccum.testing.diagnose`` name this). The running
statistics also average ``N`` micro-batch estimates, which are noisier than one
big-batch estimate. Micro-batch statistics are acceptable when a micro-batch is
large enough to estimate them (a few dozen examples per BatchNorm, as in
data-parallel training, where each device normalizes over its own shard
anyway). Otherwise use a per-example normalization, which makes the model exact
under accumulation: ``GroupNorm`` for convolutional networks, ``LayerNorm`` (or
``RMSNorm``) elsewhere.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

try:
    import flax.core
    from flax import nnx
    from flax.training import train_state
except ImportError as error:  # pragma: no cover - exercised in a core-only venv
    raise ImportError(
        "jaxaccum.flax needs Flax, which the core install leaves out: pip install "
        '"jaxaccum[flax]"'
    ) from error

import optax

from jaxaccum._metadata import OVERWRITE_WITH_GRADIENT
from jaxaccum._multisteps import MultiSteps
from jaxaccum._options import (
    COMPARE_REFUSED,
    SHARD_OPTIONS,
    AccumOptions,
    check_accepts_example_mask,
)
from jaxaccum._types import (
    Batch,
    FlaxCompareKwargs,
    FlaxKwargs,
    Fun,
    Grads,
    Params,
    PyTree,
)
from jaxaccum._value_and_grad import make_accumulated

if TYPE_CHECKING:
    from jaxaccum._diagnose import Diagnosis

__all__ = [
    "TrainState",
    "linen_diagnose",
    "linen_train_step",
    "linen_value_and_grad",
    "nnx_diagnose",
    "nnx_value_and_grad",
]

_ROLES = ("argnums", "batch_argnums", "key_argnums", "state_argnums")
_NNX_KEYS = (
    "an NNX model draws its randomness from its own nnx.Rngs, carried through "
    "the micro-batches with the model's state."
)


def _check_kwargs(helper: str, value_and_grad_kwargs: Collection[str]) -> None:
    """The Flax checks differentiate the parameters, split the batch (the
    second argument) and carry the model's state: they set those roles, and
    compare unscaled, unsharded windows."""
    AccumOptions.check_keywords(
        helper, value_and_grad_kwargs, fixed=_ROLES, refused=COMPARE_REFUSED
    )


def _collection_names(mutable: str | Sequence[str] | bool) -> tuple[str, ...]:
    if isinstance(mutable, str):
        return (mutable,)
    if not isinstance(mutable, Sequence) or not all(
        isinstance(name, str) for name in mutable
    ):
        raise TypeError(
            "mutable must name the collections fun updates, e.g. "
            f"mutable='batch_stats' or ['batch_stats'], got {mutable!r}."
        )
    return tuple(mutable)


def _linen_options(
    where: str,
    num_microbatches: int | None,
    options: Mapping[str, Any],
    collections: tuple[str, ...],
) -> AccumOptions:
    """A Linen front end's options: ``fun(variables, batch, ...)`` split as
    params (differentiated), state (the mutable collections), batch, rngs."""
    return AccumOptions.create(
        where,
        num_microbatches,
        options,
        fixed={
            "argnums": 0,
            "batch_argnums": 2,
            "key_argnums": 3,
            "state_argnums": 1 if collections else (),
        },
        refused=SHARD_OPTIONS,
    )


def linen_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    mutable: str | Sequence[str] = (),
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """Accumulates a loss that calls a Linen ``model.apply``, state and rngs too.

    The ``"params"`` collection is differentiated; the ``mutable`` collections
    are carried through the micro-batches in order, so BatchNorm's
    ``batch_stats`` after a window equal ``N`` sequential training-mode forward
    passes; other collections are passed unchanged. Each ``rngs`` stream's key
    is split per micro-batch. Guide: [Flax](../guides/flax.md#linen).

    Args:
      fun: ``fun(variables, batch, *args, **kwargs)``, calling ``model.apply``
        (with ``rngs=``, passed as a keyword when the caller passes ``rngs``).
        Returns ``(out, updates)`` with ``mutable`` (``updates`` the collections
        ``apply`` returned), else ``out``; ``out`` is the loss, or ``(loss,
        aux)`` with ``has_aux``, or what ``reduction="weighted"`` expects.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      mutable: the collections ``fun`` updates (what it passes to ``apply``'s
        ``mutable``), e.g. ``"batch_stats"``.
      has_aux: whether ``out`` is ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``microbatch_size``, ``reduction``, ``aux_reduction``,
        ``accum_dtype``, ``pad``, ``unroll``, ``remat``).

    Returns:
      ``accumulated(variables, batch, *args, rngs=None, **kwargs)`` returning
      ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), where
      ``grads`` is like ``variables["params"]``; where ``variables`` hold FP8
      metadata (Flax's ``_overwrite_with_gradient`` collection), ``grads``
      is ``{"params": ..., "_overwrite_with_gradient": <its new values>}``,
      what ``TrainState.apply_gradients`` takes; with ``mutable``,
      ``(that, updates)``, ``updates`` holding the ``mutable`` collections after
      the window, as ``apply`` returns them; with ``report_finite`` or
      ``report_stats``, ``(all that, report)``.

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import jaxaccum.flax
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False), nn.Dense(1)])
      >>> x = jnp.arange(24.0).reshape(8, 3)
      >>> variables = model.init(jax.random.key(0), x)
      >>> def loss_fn(variables, x):
      ...     out, updates = model.apply(variables, x, mutable="batch_stats")
      ...     return jnp.mean(out**2), updates
      >>> accumulated = jaxaccum.flax.linen_value_and_grad(
      ...     loss_fn, num_microbatches=2, mutable="batch_stats")
      >>> (loss, grads), updates = jax.jit(accumulated)(variables, x)
      >>> jax.tree.map(jnp.shape, updates)
      {'batch_stats': {'layers_1': {'mean': (4,), 'var': (4,)}}}
    """
    collections = _collection_names(mutable)
    options = _linen_options(
        "linen_value_and_grad",
        num_microbatches,
        {**value_and_grad_kwargs, "has_aux": has_aux},
        collections,
    )
    if options.pad:
        check_accepts_example_mask(fun)
    accumulate = {  # by whether the variables hold FP8 metadata
        fp8: make_accumulated(_linen_loss(fun, collections, has_aux, fp8), options)
        for fp8 in (False, True)
    }

    def accumulated(
        variables: Params,
        batch: Batch,
        *args: PyTree,
        rngs: Any = None,
        **kwargs: PyTree,
    ) -> PyTree:
        params, state, others = _linen_split(variables, collections)
        fp8 = _holds_metadata(params)
        return accumulate[fp8](params, state, batch, rngs, others, *args, **kwargs)

    return accumulated


def _linen_loss(
    fun: Fun, collections: tuple[str, ...], has_aux: bool, fp8: bool
) -> Callable:
    """``fun`` as ``loss(params, state, batch, rngs, others, *args)``; with
    ``fp8``, ``params`` holds the ``params`` and FP8 metadata collections."""

    def loss(params, state, batch, rngs, others, *args, **kwargs):
        variables = {**others, **state, **(params if fp8 else {"params": params})}
        if rngs is not None:
            kwargs = {**kwargs, "rngs": rngs}
        out = fun(variables, batch, *args, **kwargs)
        if not collections:
            if not has_aux and _looks_like_updates(out):
                raise TypeError(
                    "fun returned (out, updates), the collections apply "
                    f"updated ({sorted(out[1])}), but mutable=(). Pass the "
                    "collections model.apply mutates as mutable=[...]."
                )
            return out
        out, updates = out
        updates = flax.core.unfreeze(updates)
        if set(updates) != set(collections):
            raise ValueError(
                f"fun returned the collections {sorted(updates)}, but mutable="
                f"{list(collections)}. Pass the same collections to "
                "linen_value_and_grad's mutable and model.apply's mutable."
            )
        return out, updates

    return loss


def _looks_like_updates(out: PyTree) -> bool:
    return (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[1], Mapping)
        and all(isinstance(name, str) for name in out[1])
    )


def _holds_metadata(params: Params) -> bool:
    """Whether ``params`` is Flax's FP8 layout: ``params`` and its metadata."""
    return isinstance(params, dict) and OVERWRITE_WITH_GRADIENT in params


def _linen_split(variables: Params, collections: tuple[str, ...]) -> tuple:
    """``variables`` as (params, mutable collections, other collections); the
    params are ``{"params": ..., "_overwrite_with_gradient": ...}`` where the
    variables hold FP8 metadata (differentiated with the parameters, as
    Flax's recipe does), else the ``"params"`` collection."""
    variables = flax.core.unfreeze(variables)
    missing = [name for name in ("params", *collections) if name not in variables]
    if missing:
        raise ValueError(
            f"variables has no collection(s) {missing}; it has "
            f"{sorted(variables)}. Pass the whole variables dict model.init "
            "returned, and name in mutable only collections it holds."
        )
    state = {name: variables[name] for name in collections}
    others = {
        name: value
        for name, value in variables.items()
        if name != "params" and name not in collections
    }
    params = variables["params"]
    if OVERWRITE_WITH_GRADIENT in others:
        params = {
            "params": params,
            OVERWRITE_WITH_GRADIENT: others.pop(OVERWRITE_WITH_GRADIENT),
        }
    return params, state, others


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

    Compares :func:`linen_value_and_grad` with ``N`` micro-batches and with one
    (the full batch), and names why they differ, e.g. BatchNorm.

    Args:
      fun: as for :func:`linen_value_and_grad`.
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
    from jaxaccum._diagnose import diagnose  # loads chex, as jaxaccum.testing does

    _check_kwargs("linen_diagnose", value_and_grad_kwargs)
    collections = _collection_names(mutable)
    params, state, others = _linen_split(variables, collections)
    has_aux = value_and_grad_kwargs.get("has_aux", False)
    fp8 = _holds_metadata(params)
    return diagnose(
        _linen_loss(fun, collections, has_aux, fp8),
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


def linen_train_step(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    mutable: str | Sequence[str] = (),
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """A ``TrainState`` step: accumulate a window, then one ``apply_gradients``.

    Runs :func:`linen_value_and_grad` on ``{"params": state.params, <each
    mutable collection>: state.<collection>}`` and the batch, then calls
    ``state.apply_gradients`` once with the window's gradient and the updated
    collections: the optimizer, its step count and schedules see one step per
    window. Keep each mutable collection in a field of the same name, i.e.
    subclass ``flax.training.train_state.TrainState`` with ``batch_stats:
    Any``.

    Args:
      fun: as for :func:`linen_value_and_grad`; call ``model.apply`` (or
        ``state.apply_fn``, closed over) in it.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      mutable: the collections ``fun`` updates, stored back into ``state``.
      has_aux: whether ``fun``'s loss comes with aux, ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments.

    Returns:
      ``step(state, batch, *args, rngs=None, **kwargs) -> (new_state, loss)``
      (``(new_state, (loss, aux))`` with ``has_aux``; with ``report_finite``
      or ``report_stats``, the report last: ``(new_state, loss, report)``).
      Wrap it in ``jax.jit``. It applies the gradients whatever they are: with
      ``loss_scale=True`` keep ``jaxaccum.select_if_finite(report.finite,
      new_state, state)``, the old state where the window overflowed.

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax
      >>> from flax.training import train_state
      >>> import jaxaccum.flax
      >>> class TrainState(train_state.TrainState):
      ...     batch_stats: dict
      >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(False), nn.Dense(1)])
      >>> x = jnp.arange(24.0).reshape(8, 3)
      >>> variables = model.init(jax.random.key(0), x)
      >>> state = TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1),
      ...     params=variables["params"], batch_stats=variables["batch_stats"])
      >>> def loss_fn(variables, x):
      ...     out, updates = model.apply(variables, x, mutable="batch_stats")
      ...     return jnp.mean(out**2), updates
      >>> step = jax.jit(jaxaccum.flax.linen_train_step(
      ...     loss_fn, num_microbatches=4, mutable="batch_stats"))
      >>> state, loss = step(state, x)
      >>> int(state.step)
      1
    """
    collections = _collection_names(mutable)
    reports = _linen_options(
        "linen_train_step",
        num_microbatches,
        {**value_and_grad_kwargs, "has_aux": has_aux},
        collections,
    ).reports
    accumulate = linen_value_and_grad(
        fun,
        num_microbatches,
        mutable=collections,
        has_aux=has_aux,
        **value_and_grad_kwargs,
    )

    def step(
        state: train_state.TrainState,
        batch: Batch,
        *args: PyTree,
        rngs: Any = None,
        **kwargs: PyTree,
    ) -> tuple:
        missing = [name for name in collections if not hasattr(state, name)]
        if missing:
            raise AttributeError(
                f"{type(state).__name__} has no field(s) {missing} to keep the "
                "mutable collections in. Subclass TrainState with them, e.g. "
                "class TrainState(train_state.TrainState): batch_stats: Any."
            )
        variables = _train_state_variables(state.params)
        variables.update({name: getattr(state, name) for name in collections})
        result = accumulate(variables, batch, *args, rngs=rngs, **kwargs)
        result, report = result if reports else (result, None)
        updates = {}
        if collections:
            result, updates = result
        loss, grads = result
        new_state = state.apply_gradients(grads=grads, **updates)
        return (new_state, loss) if report is None else (new_state, loss, report)

    return step


def _train_state_variables(params: Params) -> dict:
    """A ``TrainState``'s ``params`` as Linen variables: Flax's FP8 recipe
    keeps the whole variables there (``params`` and the FP8 metadata)."""
    params = flax.core.unfreeze(params)
    if _holds_metadata(params):
        return params
    return {"params": params}


def _multisteps_of(tx: Any) -> MultiSteps | None:
    """The :class:`jaxaccum.MultiSteps` behind ``tx`` (``accumulate``'s
    transformation included), else None."""
    owner = getattr(getattr(tx, "init", None), "__self__", None)
    return owner if isinstance(owner, MultiSteps) else None


class TrainState(train_state.TrainState):
    """Flax's ``TrainState``, its FP8 metadata moved once per `MultiSteps` window.

    A drop-in for ``flax.training.train_state.TrainState``. Where ``tx`` is a
    :class:`jaxaccum.MultiSteps` (or ``jaxaccum.accumulate``) and ``params``
    holds FP8 metadata (Flax's ``_overwrite_with_gradient`` collection beside
    ``"params"``), ``apply_gradients`` hands each call's new metadata to the
    window (maxed over its calls) and keeps the window-start values in
    ``params`` until the window emits, when they become the window's: every
    call quantizes with the scales the big batch would, and the amax
    histories move once a window. Flax's own ``TrainState`` writes each
    call's metadata over the last, so with ``MultiSteps`` its histories roll
    once per call. Otherwise it is Flax's. Guide: [Mixed
    precision](../guides/mixed-precision.md#fp8-across-calls).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxaccum, jaxaccum.flax
      >>> params = {"params": {"w": jnp.zeros(2)},
      ...           "_overwrite_with_gradient": {"amax": jnp.zeros(1)}}
      >>> state = jaxaccum.flax.TrainState.create(
      ...     apply_fn=None, params=params, tx=jaxaccum.MultiSteps(optax.sgd(1.0), 2))
      >>> for amax in (3.0, 1.0):
      ...     grads = {"params": {"w": jnp.ones(2)},
      ...              "_overwrite_with_gradient": {"amax": jnp.full(1, amax)}}
      ...     state = state.apply_gradients(grads=grads)
      ...     print(state.params["_overwrite_with_gradient"]["amax"])
      [0.]
      [3.]
    """

    @classmethod
    def create(cls, *, apply_fn: Any, params: Params, tx: Any, **kwargs: PyTree) -> Any:
        """As Flax's ``create``; a `MultiSteps` ``tx`` also holds the metadata."""
        multisteps = _multisteps_of(tx)
        if multisteps is None or OVERWRITE_WITH_GRADIENT not in params:
            return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        opt_state = multisteps.init(
            params["params"], metadata=params[OVERWRITE_WITH_GRADIENT]
        )
        return cls(
            step=0,
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=opt_state,
            **kwargs,
        )

    def apply_gradients(self, *, grads: Grads, **kwargs: PyTree) -> Any:
        """As Flax's; the metadata held for a `MultiSteps` window (above)."""
        multisteps = _multisteps_of(self.tx)
        if multisteps is None or OVERWRITE_WITH_GRADIENT not in grads:
            return super().apply_gradients(grads=grads, **kwargs)
        updates, opt_state = multisteps.update(
            grads["params"],
            self.opt_state,
            self.params["params"],
            metadata=grads[OVERWRITE_WITH_GRADIENT],
        )
        params = {
            "params": optax.apply_updates(self.params["params"], updates),
            OVERWRITE_WITH_GRADIENT: multisteps.metadata(
                opt_state, self.params[OVERWRITE_WITH_GRADIENT]
            ),
        }
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, **kwargs
        )


def nnx_value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    **value_and_grad_kwargs: Unpack[FlaxKwargs],
) -> Fun:
    """``nnx.value_and_grad`` over micro-batches, the model's state carried in order.

    The model's ``wrt`` Variables are differentiated; every other Variable
    (``nnx.BatchStat``, RNG stream counters, ...) is carried through the
    micro-batches in order and written back into the model after the window,
    as ``N`` sequential training-mode forward passes leave it. Works in
    ``nnx.jit`` and, on a model merged inside the function, ``jax.jit``. What
    cannot be carried: [Flax](../guides/flax.md#nnx).

    Args:
      fun: the loss, ``fun(model, batch, *args, **kwargs)`` (``(loss, aux)``
        with ``has_aux``), which may update the model's state; ``batch`` is
        split into micro-batches, other arguments are passed unchanged.
      num_microbatches: ``N``, as for :func:`jaxaccum.value_and_grad`.
      wrt: an ``nnx`` filter of the Variables to differentiate, as for
        ``nnx.Optimizer``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      **value_and_grad_kwargs: the other :func:`jaxaccum.value_and_grad`
        arguments (``microbatch_size``, ``reduction``, ``aux_reduction``,
        ``accum_dtype``, ``pad``, ``unroll``, ``remat``).

    Returns:
      ``accumulated(model, batch, *args, **kwargs)`` returning ``(loss,
      grads)`` (``((loss, aux), grads)`` with ``has_aux``), ``grads`` an
      ``nnx.State`` of the ``wrt`` Variables, ready for
      ``optimizer.update(model, grads)``; with ``report_finite`` or
      ``report_stats``, ``(that, report)``. The model's other state is
      updated in place.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxaccum.flax
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
      ...                        nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> def loss_fn(model, x):
      ...     return jnp.mean(model(x) ** 2)
      >>> @nnx.jit
      ... def train_step(model, optimizer, x):
      ...     loss, grads = jaxaccum.flax.nnx_value_and_grad(
      ...         loss_fn, num_microbatches=2)(model, x)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.arange(24.0).reshape(8, 3))
      >>> model.layers[1].mean[...].shape
      (4,)
    """
    options = AccumOptions.create(
        "nnx_value_and_grad",
        num_microbatches,
        {**value_and_grad_kwargs, "has_aux": has_aux},
        fixed={"argnums": 0, "batch_argnums": 2, "state_argnums": 1},
        refused={**SHARD_OPTIONS, "key_argnums": _NNX_KEYS},
    )
    if options.pad:
        check_accepts_example_mask(fun)

    def accumulated(
        model: Params, batch: Batch, *args: PyTree, **kwargs: PyTree
    ) -> PyTree:
        _check_no_graph_nodes(args)
        micro_loss, params, state = _nnx_loss(fun, model, wrt)
        out = make_accumulated(micro_loss, options)(
            params, state, batch, *args, **kwargs
        )
        out, report = out if options.reports else (out, None)
        result, new_state = out
        nnx.update(model, new_state)
        return result if report is None else (result, report)

    return accumulated


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

    Compares :func:`nnx_value_and_grad` with ``N`` micro-batches and with one
    (the full batch), and names why they differ. The model is not changed.

    Args:
      fun: as for :func:`nnx_value_and_grad`.
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
    from jaxaccum._diagnose import diagnose  # loads chex, as jaxaccum.testing does

    _check_kwargs("nnx_diagnose", value_and_grad_kwargs)
    _check_no_graph_nodes(args)
    loss, params, state = _nnx_loss(fun, model, wrt)
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


def _check_no_graph_nodes(args: tuple) -> None:
    for index, arg in enumerate(args):
        if nnx.graph.is_graph_node(arg):
            raise TypeError(
                f"Argument {index + 2} is an NNX {type(arg).__name__}; only the "
                "state of the model (the first argument) is carried through the "
                "micro-batches. Make it an attribute of the model."
            )


def _nnx_loss(fun: Fun, model: Params, wrt: Any) -> tuple:
    """``fun`` as ``loss(params, state, batch, *args) -> (out, new_state)``, with
    the model's ``wrt`` Variables as ``params`` and the rest as ``state``."""
    graphdef, *states = nnx.split(model, wrt, ...)
    params, state = states

    def loss(params, state, batch, *args, **kwargs):
        # copy=True: the Variables must belong to this trace to be updated.
        model = nnx.merge(graphdef, params, state, copy=True)
        out = fun(model, batch, *args, **kwargs)
        new_state = nnx.split(model, wrt, ...)[2]
        _check_same_variables(state, new_state)
        return out, new_state

    return loss, params, state


def _check_same_variables(state: nnx.State, new_state: nnx.State) -> None:
    """The model after ``fun`` must hold the same non-differentiated Variables."""
    before = {path for path, _ in nnx.to_flat_state(state)}
    after = {path for path, _ in nnx.to_flat_state(new_state)}
    if before != after:
        added = ["/".join(map(str, path)) for path in sorted(after - before)]
        removed = ["/".join(map(str, path)) for path in sorted(before - after)]
        raise ValueError(
            f"fun changed which Variables the model holds (added: {added}, "
            f"removed: {removed}); the model's state is carried from one "
            "micro-batch to the next, so it must keep its Variables. nnx.pop "
            "sown intermediates inside fun and return them as aux."
        )
