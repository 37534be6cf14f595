"""Across-call accumulation: an Optax wrapper that steps once per window.

`MultiSteps` is a drop-in replacement for `optax.MultiSteps` (same constructor,
methods and state field names). It differs in cost and exactness:

- A mid-window call only adds the gradient into a float32 accumulator and
  emits zeros; the wrapped optimizer's update runs under `jax.lax.cond` on the
  emitting call alone. `optax.MultiSteps` runs it on every call and masks the
  result, paying a full optimizer update (passes over Adam's ``mu`` and ``nu``)
  per mini-step.
- An optional ``weight`` per call (e.g. the number of tokens in the
  micro-batch) makes the window emit ``sum(w * g) / sum(w)``, the token-exact
  mean, through the same normalisation as `jaxaccum.value_and_grad`.
- The window's length can come from outside the state, traced: ``every_k=``
  on ``update`` (e.g. a batch-size controller's ``num_microbatches``), and
  :meth:`MultiSteps.window_stats` hands the controller what the window
  measured. One compiled step serves windows of every length.
- An optional float16 loss scale (``loss_scale=``) is held for the window:
  an overflow in any call skips the whole window and backs the scale off.
- FP8 metadata (``update(..., metadata=)``) is maxed over the window's calls
  and held: :meth:`MultiSteps.metadata` gives the window-start values mid-window
  and the window's new values once, at its end (``jaxaccum.flax.TrainState``
  wires it into ``apply_gradients``).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _loss_scale, _metadata, _window_noise
from jaxaccum._loss_scale import DynamicLossScale, WindowLossScale
from jaxaccum._noise_scale import NoiseEstimates, WindowStats
from jaxaccum._options import check_scalar, static_scalar
from jaxaccum._reduce import divide_by_total_weight
from jaxaccum._types import Fun, Grads, PyTree
from jaxaccum._window import accum_dtype_for
from jaxaccum._window_noise import WindowNoise

EveryKSchedule = int | Callable[[jax.Array], jax.typing.ArrayLike]


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`; the fields of `optax.MultiStepsState` plus three.

    Attributes:
      mini_step: int32 scalar, accepted calls so far in the current window;
        reset to 0 by the emitting call.
      gradient_step: int32 scalar, windows completed, i.e. inner optimizer steps.
      inner_opt_state: the state of the wrapped optimizer; it changes only on
        emitting calls.
      acc_grads: sum of ``weight * gradient`` over the window, in the
        accumulator dtype (optax stores a running mean here). The emitting call
        leaves in it the updates it emitted (in the accumulator dtype): the
        wrapped optimizer has read the sum by then, and carrying the updates
        out through this buffer spares every call a parameter-sized temporary
        (see `MultiSteps`). The next accepted call, which starts a new window,
        overwrites it: this lazy reset saves a pass over the accumulator.
      skip_state: whatever ``should_skip_update_fn`` returned on the last call
        (monitoring information), ``()`` without one.
      acc_weight: float32 scalar, the window's total weight (the number of
        accepted calls when no ``weight`` is passed); reset like ``acc_grads``.
      noise: with ``track_noise_scale``, the window's squared norms (a
        ``WindowNoise``: their sum over calls, the calls counted, the last
        emitted window's); ``()`` without.
      loss_scale: with ``loss_scale``, a ``WindowLossScale``: the window's
        :class:`jaxaccum.DynamicLossScale` and whether its calls were all
        finite; ``()`` without.
      metadata: with ``init(..., metadata=)``, the FP8 metadata's maximum over
        the window's accepted calls, in float32 (reset like ``acc_grads``):
        the window's new metadata once it emits; ``()`` without.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: PyTree
    acc_grads: Grads
    skip_state: Any = ()
    acc_weight: jax.Array | float = 0.0
    noise: WindowNoise | tuple = ()
    loss_scale: WindowLossScale | tuple = ()
    metadata: PyTree = ()


class _WindowSums(NamedTuple):
    """The window's sums after a call, lazily reset like ``acc_grads``."""

    acc_grads: Grads
    acc_weight: jax.Array
    noise: WindowNoise | tuple


def _never_skip(
    updates: optax.Updates,
    gradient_step: jax.typing.ArrayLike,
    params: optax.Params | None,
) -> tuple[jax.Array, Any]:
    del updates, gradient_step, params
    return jnp.array(False), ()


def _check_every_k(
    every_k: jax.typing.ArrayLike, source: str, hint: str
) -> jax.typing.ArrayLike:
    """Rejects a window length that is not an integer scalar, or a concrete
    one below 1; ``source`` names where it came from, ``hint`` the fix."""
    check_scalar(source, every_k, integer=True, low=1, hint=hint)
    return every_k


def _check_weight(weight: PyTree) -> jax.Array:
    """Returns ``weight`` as a float32 scalar, or raises saying what is wrong
    (a concrete weight must be a finite number >= 0; a traced one that is not
    gives NaN, so the window it joins emits NaN)."""
    try:
        # A Python number as float32 (an int past int32 is still a weight).
        plain = isinstance(weight, int | float) and not isinstance(weight, bool)
        with np.errstate(over="ignore"):  # 1e300 is refused below, by name
            array = jnp.asarray(weight, jnp.float32 if plain else None)
    except TypeError as error:
        raise TypeError(
            f"weight must be a scalar number or array, got {type(weight).__name__}."
            " Pass the micro-batch's number of tokens (or examples) as a scalar."
        ) from error
    if array.shape != ():
        raise ValueError(
            f"weight must be a scalar (shape ()), got shape {array.shape}. "
            "Pass the micro-batch's total weight, e.g. mask.sum(), not the "
            "per-example weights."
        )
    if not jnp.issubdtype(array.dtype, jnp.number):
        raise TypeError(
            f"weight must be numeric, got dtype {array.dtype}. "
            "Pass e.g. mask.sum() or a float."
        )
    check_scalar(  # the value as passed: float32 would hide 1e300 and 1e-300
        "weight",
        weight,
        integer=False,
        low=0.0,
        hint="It is this call's share of the window (its tokens or examples).",
    )
    weight = array.astype(jnp.float32)
    # Traced, it cannot be checked: a negative or non-finite weight makes the
    # window's sums NaN, never a plausible gradient.
    return jnp.where(jnp.isfinite(weight) & (weight >= 0), weight, jnp.nan)


def _check_schedule(every_k_schedule: Any) -> EveryKSchedule | None:
    """``every_k_schedule`` checked: a function, None, or a count (a Python
    int after the check)."""
    if every_k_schedule is None or callable(every_k_schedule):
        return every_k_schedule
    return static_scalar(
        "every_k_schedule",
        every_k_schedule,
        integer=True,
        low=1,
        hint="Pass an int or a function of gradient_step (calls per window; 1 "
        "steps on every call), or None with update(..., every_k=...) on every "
        "call.",
    )


def _window_length(
    schedule: EveryKSchedule | None,
    gradient_step: jax.Array,
    every_k: jax.typing.ArrayLike | None,
) -> jax.typing.ArrayLike:
    """The current window's length: ``every_k`` if the call passes it, else
    the schedule's value at ``gradient_step``."""
    if every_k is not None:
        return _check_every_k(
            every_k, "every_k", "Pass e.g. every_k=controller_state.num_microbatches."
        )
    if schedule is None:
        raise TypeError(
            "MultiSteps(every_k_schedule=None) takes the window length from "
            "each call: update(..., every_k=num_calls), e.g. "
            "every_k=controller_state.num_microbatches."
        )
    if isinstance(schedule, int):
        return schedule
    return _check_every_k(
        schedule(gradient_step),
        "every_k_schedule(gradient_step)",
        "Return e.g. jnp.where(gradient_step < 100, 1, 4).",
    )


def _should_skip(
    should_skip_update_fn: Fun,
    updates: optax.Updates,
    gradient_step: jax.Array,
    params: optax.Params | None,
    weight: jax.Array | None,
) -> tuple[jax.Array, Any]:
    """Whether to drop this call, and the skip function's state."""
    should_skip, skip_state = should_skip_update_fn(updates, gradient_step, params)
    should_skip = jnp.asarray(should_skip)
    if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "should_skip_update_fn must return a boolean scalar first, got "
            f"dtype {should_skip.dtype} and shape {should_skip.shape}."
        )
    if weight is not None and should_skip_update_fn is not _never_skip:
        # The skip function sees only the gradient; a NaN or inf weight
        # would poison the window just the same.
        should_skip = should_skip | ~jnp.isfinite(weight)
    return should_skip, skip_state


def _unscaled_call(
    updates: optax.Updates, window: WindowLossScale, weight: jax.Array | None
) -> tuple[Any, jax.Array]:
    """This call's gradient unscaled (in at least float32), and whether it
    (and its weight) is finite."""
    finite = _loss_scale.tree_finite(updates)
    if weight is not None:
        finite = finite & jnp.isfinite(weight)
    return _loss_scale.unscale(updates, window.scale.loss_scale), finite


class _Verdict(NamedTuple):
    """What a call does to its window: dropped (``should_skip_update_fn``),
    closing it, applying it (emitting), and the loss scale after the call."""

    should_skip: jax.Array
    closes: jax.Array
    emit: jax.Array
    loss_scale: WindowLossScale | tuple


def _verdict(
    state: MultiStepsState,
    should_skip: jax.Array,
    call_finite: jax.Array | None,
    every_k: jax.typing.ArrayLike,
) -> _Verdict:
    """The call's :class:`_Verdict`; ``call_finite`` (with a loss scale)
    whether its gradient was finite, else None."""
    if call_finite is not None:
        # A call that is not finite is the window's: it counts, and the window
        # it belongs to is skipped whole.
        should_skip = should_skip & call_finite
    closes = jnp.logical_and(~should_skip, state.mini_step + 1 >= every_k)
    if call_finite is None:
        return _Verdict(should_skip, closes, closes, state.loss_scale)
    assert isinstance(state.loss_scale, WindowLossScale)  # checked by update
    loss_scale = _loss_scale.after_call(
        state.loss_scale, call_finite, state.mini_step == 0, should_skip, closes
    )
    return _Verdict(should_skip, closes, closes & loss_scale.finite, loss_scale)


def _emit(
    opt: optax.GradientTransformationExtraArgs,
    grads: Grads,
    inner_opt_state: PyTree,
    updates: optax.Updates,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> tuple[optax.Updates, Any]:
    """The emitting call: the wrapped optimizer on the window's gradient, cast
    like this call's ``updates``."""
    new_updates, new_inner_state = opt.update(
        optax.tree.cast_like(grads, updates), inner_opt_state, params, **extra_args
    )
    # Both branches must return the same dtypes; keep the state's (as optax
    # does), which also keeps it stable as a lax.scan carry.
    new_inner_state = jax.tree.map(
        lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
        new_inner_state,
        inner_opt_state,
    )
    return new_updates, new_inner_state


def _add_call(
    updates: optax.Updates,
    state: MultiStepsState,
    weight: jax.Array | None,
    should_skip: jax.Array,
) -> _WindowSums:
    """This call's share of the window's sums."""
    # The reset is lazy: the first accepted call of a window overwrites the
    # previous window's sum instead of an extra pass writing zeros.
    window_start = state.mini_step == 0

    def into_window(acc: jax.Array, value: jax.Array) -> jax.Array:
        new_sum = jnp.where(window_start, value, acc + value)
        # Selects, not branches: they fuse into the add's single pass.
        return jnp.where(should_skip, acc, new_sum)

    def add_to_window(acc: jax.Array, grad: jax.Array) -> jax.Array:
        grad = grad.astype(acc.dtype)
        if weight is not None:
            grad = weight.astype(acc.dtype) * grad
        return into_window(acc, grad)

    acc_grads = jax.tree.map(add_to_window, state.acc_grads, updates)
    acc_weight = add_to_window(
        jnp.asarray(state.acc_weight, jnp.float32), jnp.ones([], jnp.float32)
    )
    noise = state.noise
    if isinstance(noise, WindowNoise):  # track_noise_scale
        noise = _window_noise.add_call(noise, updates, weight, into_window)
    return _WindowSums(acc_grads, acc_weight, noise)


def _close_or_carry(
    emit: jax.Array,
    sums: _WindowSums,
    inner_opt_state: PyTree,
    emit_window: Callable[[Any, Any], tuple[optax.Updates, Any]],
) -> tuple[optax.Updates, Any, _WindowSums]:
    """The call's updates, inner state and sums: ``emit_window``'s on the
    emitting call, else zeros and the state passed through."""

    def emit_into_accumulator(acc_grads, inner_opt_state):
        # The window's sum is dead once the inner optimizer has read it: its
        # buffer carries the updates out of the cond (see below).
        new_updates, new_inner_state = emit_window(acc_grads, inner_opt_state)
        carried = jax.tree.map(
            lambda update, acc: update.astype(acc.dtype), new_updates, acc_grads
        )
        noise = sums.noise
        if isinstance(noise, WindowNoise):  # track_noise_scale
            noise = _window_noise.emitted(noise, acc_grads, sums.acc_weight)
        return carried, new_inner_state, noise

    def mid_window(acc_grads, inner_opt_state):
        return acc_grads, inner_opt_state, sums.noise

    # Mid-window the accumulator and the inner state pass through the cond
    # untouched; with the state donated, XLA keeps both in place. The updates
    # are selected outside the cond, from the accumulator's buffer: a cond
    # output of their own would be a parameter-sized temporary, freshly
    # allocated (and page-faulted) by every call, while a select fuses into
    # the caller's `params + updates`.
    update_shapes, _ = jax.eval_shape(emit_window, sums.acc_grads, inner_opt_state)
    acc_grads, inner_opt_state, noise = jax.lax.cond(
        emit, emit_into_accumulator, mid_window, sums.acc_grads, inner_opt_state
    )
    new_updates = jax.tree.map(
        lambda acc, shape: jnp.where(
            emit, acc.astype(shape.dtype), jnp.zeros((), shape.dtype)
        ),
        acc_grads,
        update_shapes,
    )
    return new_updates, inner_opt_state, sums._replace(acc_grads=acc_grads, noise=noise)


class MultiSteps:
    """Accumulates gradients over calls; the wrapped optimizer steps once a window.

    A drop-in replacement for `optax.MultiSteps` with the same constructor,
    methods and state field names. Each call adds its gradient (cast to
    ``accumulator_dtype``) into ``acc_grads`` and returns exact zeros, without
    running the wrapped optimizer. The call that completes a window of
    ``every_k_schedule(gradient_step)`` accepted calls runs the wrapped
    optimizer once, on the window's mean (or sum) gradient cast back to the
    gradient dtype, and returns its updates; the next window starts from zero.
    So Adam's count, learning-rate schedules, ``clip_by_global_norm`` and weight
    decay see one step per window.

    Pass ``weight=`` to ``update`` (e.g. the micro-batch's token count) to get
    the token-exact window mean ``sum(w * g) / sum(w)``; other extra arguments
    are forwarded to the wrapped optimizer on the emitting call. Jit the train
    step with the params and the state donated: how that keeps a mid-window
    call in place is in the guide [Micro-batches across
    calls](../guides/multisteps.md#what-a-call-costs). With ``loss_scale``,
    each call's loss is multiplied by :meth:`loss_scale` and a window with a
    non-finite call is skipped whole: [Mixed
    precision](../guides/mixed-precision.md#across-calls-multisteps).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum
      >>> opt = jaxaccum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> for g in (1.0, 3.0):
      ...     updates, state = opt.update({"w": jnp.full(2, g)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"]
      Array([-2., -2.], dtype=float32)
      >>> bool(opt.has_updated(state))
      True
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: EveryKSchedule | None,
        use_grad_mean: bool = True,
        should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
        track_noise_scale: bool = False,
        loss_scale: DynamicLossScale | None = None,
    ):
        """Initializer.

        Args:
          opt: the wrapped optimizer.
          every_k_schedule: calls per window: an int >= 1, or a function of the
            int32 ``gradient_step`` returning one (read once per window); None
            if every call passes ``update(..., every_k=)``.
          use_grad_mean: emit the window's weighted mean gradient ``sum(w *
            g) / sum(w)`` (``w = 1`` without ``weight``) if True, else the sum.
          should_skip_update_fn: as ``optax.skip_not_finite``; a call it
            rejects leaves the state but ``skip_state`` bitwise unchanged
            (with ``loss_scale``, a non-finite call is the window's).
          accumulator_dtype: the least precise dtype of ``acc_grads`` (float32:
            bfloat16 and float16 gradients sum in float32); None keeps the
            params' dtypes.
          track_noise_scale: keep the window's squared norms, for
            :meth:`window_stats` and :meth:`noise_estimates`.
          loss_scale: the first window's :class:`jaxaccum.DynamicLossScale`,
            kept in the state; each call's loss is multiplied by
            :meth:`loss_scale`, and a window with a non-finite call is skipped
            whole (the scale backed off; grown after ``period`` finite ones).
        """
        self._opt = optax.with_extra_args_support(opt)
        self._every_k_schedule = _check_schedule(every_k_schedule)
        self._use_grad_mean = use_grad_mean
        self._should_skip_update_fn = should_skip_update_fn or _never_skip
        self._accumulator_dtype = accumulator_dtype
        self._track_noise_scale = track_noise_scale
        self._loss_scale = None
        if loss_scale is not None:
            self._loss_scale = _loss_scale.check_loss_scale("loss_scale", loss_scale)

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer, with extra-args support."""
        return self._opt

    def init(self, params: optax.Params, metadata: PyTree = None) -> MultiStepsState:
        """The state at the start of the first window: zero counters and
        accumulator, ``params`` given to the wrapped optimizer's ``init``;
        ``metadata``, the FP8 metadata (Flax's ``_overwrite_with_gradient``
        collection) if every call passes its new values (``update(...,
        metadata=)``)."""
        gradient_step = jnp.zeros([], jnp.int32)
        _, skip_state = self._should_skip_update_fn(
            optax.tree.zeros_like(params), gradient_step, params
        )
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=_zero_accumulator(params, self._accumulator_dtype),
            skip_state=skip_state,
            acc_weight=jnp.zeros([], jnp.float32),
            noise=_window_noise.init_window_noise() if self._track_noise_scale else (),
            loss_scale=_loss_scale.first_window(self._loss_scale),
            metadata=() if metadata is None else _window_metadata(metadata),
        )

    def update(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        *,
        every_k: jax.typing.ArrayLike | None = None,
        **extra_args: PyTree,
    ) -> tuple[optax.Updates, MultiStepsState]:
        """Accumulates ``updates``; returns the wrapped optimizer's on a window's end.

        Args:
          updates: this call's gradients, a pytree like the params.
          state: the state from `init` or the previous call.
          params: the current params, forwarded to the wrapped optimizer.
          every_k: the current window's length in calls, an integer scalar >=
            1 (traced under ``jit``), in place of ``every_k_schedule``: e.g.
            ``controller_state.num_microbatches``, decided a window ahead. A
            value changed mid-window ends the window at the first call whose
            accepted calls reach it.
          **extra_args: ``weight`` (this call's share of the window, e.g. its
            tokens; default 1), ``metadata`` (the FP8 metadata's new values
            from this call, with a state ``init`` gave metadata: maxed over
            the window, read back with :meth:`metadata`) and the wrapped
            optimizer's extra arguments.

        Returns:
          ``(updates, new_state)``: exact zeros mid-window, the wrapped
          optimizer's updates on the emitting call, in its dtypes.
        """
        weight = extra_args.pop("weight", None)
        if weight is not None:
            weight = _check_weight(weight)
        metadata = _check_metadata(state, extra_args.pop("metadata", None))
        every_k = _window_length(self._every_k_schedule, state.gradient_step, every_k)
        grads, call_finite = updates, None
        if self._loss_scale is not None:
            grads, call_finite = _unscaled_call(
                updates, _window_scale(self._loss_scale, state, "update"), weight
            )
        should_skip, skip_state = _should_skip(
            self._should_skip_update_fn, grads, state.gradient_step, params, weight
        )
        should_skip, closes, emit, loss_scale = _verdict(
            state, should_skip, call_finite, every_k
        )
        sums = _add_call(grads, state, weight, should_skip)

        def emit_window(acc_grads, inner_opt_state):
            grads = acc_grads
            if self._use_grad_mean:
                grads = divide_by_total_weight(acc_grads, sums.acc_weight)
            return _emit(self._opt, grads, inner_opt_state, updates, params, extra_args)

        new_updates, inner_opt_state, sums = _close_or_carry(
            emit, sums, state.inner_opt_state, emit_window
        )
        mini_step, gradient_step = _counters(state, closes, should_skip, emit)
        new_state = MultiStepsState(
            mini_step,
            gradient_step,
            inner_opt_state,
            sums.acc_grads,
            skip_state,
            sums.acc_weight,
            sums.noise,
            loss_scale,
            _max_into_window(state, metadata, should_skip),
        )
        return new_updates, new_state

    def has_updated(self, state: MultiStepsState | Any) -> jax.Array:
        """Whether the call that produced ``state`` (a `MultiStepsState`)
        emitted an update: a boolean scalar, True right after a window's
        emitting call (not after one that a loss scale's overflow skipped)."""
        updated = jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)
        if isinstance(state.loss_scale, WindowLossScale):
            updated = updated & state.loss_scale.finite
        return updated

    def metadata(self, state: MultiStepsState, current: PyTree) -> PyTree:
        """The FP8 metadata to run the next call with: the window's new values
        (the max of its calls') right after an emitting call
        (:meth:`has_updated`), else ``current``, the values the window started
        with. So every call of a window quantizes with the same scales, as
        the big batch would, and the histories move once per window.

        Args:
          state: the state the last call returned; ``init`` got ``metadata``.
          current: the metadata the last call ran with, in its dtypes.

        Returns:
          A tree like ``current``.

        Raises:
          ValueError: for a state whose ``init`` got no ``metadata``, or a
            ``current`` not shaped like it.
        """
        if _holds_no_metadata(state):
            raise ValueError(_NO_METADATA)
        _check_layout("MultiSteps.metadata's current", current, state.metadata)
        updated = self.has_updated(state)
        return jax.tree.map(
            lambda new, old: _metadata.as_dtype(
                jnp.where(updated, new, _metadata.physical(old)), old.dtype
            ),
            state.metadata,
            current,
        )

    def loss_scale(self, state: MultiStepsState) -> jax.Array:
        """The scale to multiply this call's loss by: the current window's, a
        float32 scalar, the same for every call of a window (an example:
        [Mixed precision](../guides/mixed-precision.md#across-calls-multisteps)).

        Raises:
          ValueError: for a `MultiSteps` built without ``loss_scale``.
        """
        return _window_scale(self._loss_scale, state, "loss_scale").scale.loss_scale

    def noise_estimates(self, state: MultiStepsState) -> NoiseEstimates:
        """The gradient noise estimates of the window the last call emitted:
        :meth:`window_stats`' ``gradient_norm_sq``, ``gradient_noise_trace``
        and ``noise_scale``, in the units of ``weight=`` (NaN on other calls).

        Args:
          state: the state an emitting call returned.

        Returns:
          A :class:`jaxaccum.NoiseEstimates`.

        Raises:
          ValueError: without ``track_noise_scale=True``.
        """
        stats = _tracked_stats(self, state, "noise_estimates")
        return NoiseEstimates(
            stats.gradient_norm_sq, stats.gradient_noise_trace, stats.noise_scale
        )

    def window_stats(self, state: MultiStepsState) -> WindowStats:
        """What the window the last call emitted measured, for a controller.

        The window's :class:`jaxaccum.WindowStats` from its sums, as after an
        in-step window of its ``N`` calls of non-zero weight: ``big_batch``
        the window's total weight ``W`` (pass each call's examples or tokens
        as ``weight=``; a call weighs 1 without), ``grad_sq_norm`` and the
        estimates with ``b = W / N`` (NaN for ``N = 1``), ``finite`` whether
        every accepted call's gradient was; the per-micro-batch fields are
        empty. Right after an emitting call (:meth:`has_updated`) only: on
        other calls the scalars are NaN and ``finite`` False; see [the
        guide](../guides/multisteps.md#a-window-whose-length-changes).

        Args:
          state: the state an emitting call returned.

        Returns:
          The window's :class:`jaxaccum.WindowStats`.

        Raises:
          ValueError: without ``track_noise_scale=True``.

        Examples:
          >>> import jax.numpy as jnp
          >>> import optax
          >>> import jaxaccum
          >>> ramp = jaxaccum.growth.BatchRamp(4, {0: 2, 16: 4})
          >>> opt = jaxaccum.MultiSteps(optax.sgd(0.1), None, track_noise_scale=True)
          >>> params = jnp.zeros(2)
          >>> state, ramp_state, sizes = opt.init(params), ramp.init(), []
          >>> for call in range(10):  # each call: a micro-batch of 4 examples
          ...     grads = jnp.array([1.0, -1.0]) * call
          ...     num = ramp_state.num_microbatches  # this window's calls
          ...     _, state = opt.update(grads, state, params, weight=4, every_k=num)
          ...     if opt.has_updated(state):
          ...         sizes.append(int(num))
          ...         ramp_state = ramp.update(ramp_state, opt.window_stats(state))
          >>> sizes, float(ramp_state.examples_seen.total)
          ([2, 2, 4], 32.0)
          >>> float(opt.window_stats(state).big_batch)  # mid-window
          nan
        """
        return _tracked_stats(self, state, "window_stats")

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Returns this wrapper as an ``optax.GradientTransformationExtraArgs``."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)


def _zero_accumulator(params: optax.Params, accumulator_dtype: Any) -> PyTree:
    """Zeros like ``params``, each in its dtype promoted to ``accumulator_dtype``."""
    return jax.tree.map(
        lambda param: jnp.zeros_like(
            param, accum_dtype_for(param.dtype, accumulator_dtype)
        ),
        params,
    )


_NO_METADATA = (
    "MultiSteps holds FP8 metadata only if init got it: "
    "opt.init(params, metadata=variables['_overwrite_with_gradient']) (or "
    "jaxaccum.flax.TrainState.create, which does so)."
)


def _holds_no_metadata(state: MultiStepsState) -> bool:
    return isinstance(state.metadata, tuple) and not state.metadata


def _window_metadata(metadata: PyTree) -> PyTree:
    """The state's running max of the metadata: float32 zeros like it."""
    return jax.tree.map(
        lambda leaf: jnp.zeros(jnp.shape(leaf), _metadata.physical_dtype(leaf.dtype)),
        metadata,
    )


def _check_metadata(state: MultiStepsState, metadata: PyTree) -> PyTree:
    """``metadata`` passed to ``update``, checked against what ``init`` got."""
    held = state.metadata
    if metadata is None:
        if not _holds_no_metadata(state):
            raise ValueError(
                "this MultiSteps state holds FP8 metadata (init got it): pass "
                "each call's new values, update(..., metadata=grads["
                "'_overwrite_with_gradient']), or build the state without it."
            )
        return None
    if _holds_no_metadata(state):
        raise ValueError(_NO_METADATA)
    _check_layout("update's metadata", metadata, held)
    return metadata


def _check_layout(name: str, metadata: PyTree, held: PyTree) -> None:
    """That ``metadata`` (``name``) has the leaves and shapes ``init`` got."""
    given, expected = _layout(metadata), _layout(held)
    if given != expected:
        raise ValueError(
            f"{name} is not shaped like the metadata init got: {given} against "
            f"{expected}. Pass the same collection every call "
            "(variables['_overwrite_with_gradient'])."
        )


def _layout(tree: PyTree) -> list[tuple[str, tuple[int, ...]]]:
    """Each leaf's path (``keystr``) and shape."""
    return [
        (jax.tree_util.keystr(path), jnp.shape(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _max_into_window(
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


def _counters(
    state: MultiStepsState, closes: jax.Array, should_skip: jax.Array, emit: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``mini_step`` and ``gradient_step`` after a call: the first reset when
    the call closes its window (emitted or skipped whole), kept when the call
    is dropped; the second advanced when it emits."""
    mini_step = jnp.where(
        closes, 0, jnp.where(should_skip, state.mini_step, state.mini_step + 1)
    ).astype(jnp.int32)
    gradient_step = jnp.where(
        emit, optax.safe_increment(state.gradient_step), state.gradient_step
    )
    return mini_step, gradient_step


def _window_scale(
    loss_scale: DynamicLossScale | None, state: MultiStepsState, method: str
) -> WindowLossScale:
    """The state's window loss scale, or an error naming ``method``."""
    if loss_scale is None or not isinstance(state.loss_scale, WindowLossScale):
        raise ValueError(
            f"{method} needs the window's loss scale: build "
            "MultiSteps(..., loss_scale=jaxaccum.dynamic_loss_scale()) and "
            "pass the state its init returned."
        )
    return state.loss_scale


def _tracked_stats(
    multisteps: MultiSteps, state: MultiStepsState, method: str
) -> WindowStats:
    """:meth:`MultiSteps.window_stats` from the state's sums, NaN mid-window;
    an error naming ``method`` without ``track_noise_scale``."""
    if not (multisteps._track_noise_scale and isinstance(state.noise, WindowNoise)):
        raise ValueError(
            f"{method} needs the window's squared norms: build "
            "MultiSteps(..., track_noise_scale=True)."
        )
    return _window_noise.window_stats(
        state.noise, jnp.asarray(state.acc_weight), multisteps.has_updated(state)
    )


def accumulate(
    opt: optax.GradientTransformation,
    every_k: EveryKSchedule | None,
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
    accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
    track_noise_scale: bool = False,
    loss_scale: DynamicLossScale | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``opt`` to step once per ``every_k`` calls; functional `MultiSteps`.

    Args:
      opt: the wrapped optimizer.
      every_k: calls per window, an int >= 1 or a function of
        ``gradient_step``; or None, with ``update(..., every_k=...)`` on every
        call (see :meth:`MultiSteps.update`).
      use_grad_mean: emit the window's (weighted) mean if True, else its sum.
      should_skip_update_fn: optional, e.g. ``optax.skip_not_finite``.
      accumulator_dtype: dtype of the accumulator, float32 by default.
      track_noise_scale: keep the window's squared gradient norms (see
        :meth:`MultiSteps.noise_estimates`).
      loss_scale: a :class:`jaxaccum.DynamicLossScale` held per window (see
        :class:`MultiSteps`; read it from the state's ``loss_scale.scale``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `MultiStepsState` and whose ``update`` accepts ``weight=`` and
      ``every_k=``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxaccum
      >>> opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
      >>> opt = jaxaccum.accumulate(opt, every_k=4)
      >>> params = {"w": jnp.zeros(3)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.ones(3)}, state, params, weight=7)
      >>> updates["w"]
      Array([0., 0., 0.], dtype=float32)
    """
    return MultiSteps(
        opt,
        every_k,
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        accumulator_dtype=accumulator_dtype,
        track_noise_scale=track_noise_scale,
        loss_scale=loss_scale,
    ).gradient_transformation()
