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

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum._checks import check_accum_dtype
from jaxaccum._multisteps import _noise as _window_noise
from jaxaccum._multisteps._inputs import (
    EveryKSchedule,
    call_skipped,
    check_schedule,
    check_weight,
    never_skip,
    refuse_axis_name,
    window_length,
)
from jaxaccum._multisteps._metadata import (
    check_metadata,
    max_into_window,
    next_metadata,
    window_metadata,
)
from jaxaccum._multisteps._noise import WindowNoise
from jaxaccum._multisteps._state import MultiStepsState, zero_accumulator
from jaxaccum._multisteps._window import (
    add_call,
    close_or_carry,
    counters,
    inner_update,
    unscaled_call,
    verdict,
    window_scale,
)
from jaxaccum._precision import _loss_scale
from jaxaccum._precision._loss_scale import DynamicLossScale, WindowLossScale
from jaxaccum._types import PyTree
from jaxaccum._window._noise_scale import NoiseEstimates, WindowStats
from jaxaccum._window._reduce import divide_by_total_weight


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
        *,
        axis_name: None = None,
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
          axis_name: not taken (a ``TypeError`` if given): a window spread
            over calls cannot meet over a named axis.
        """
        refuse_axis_name(axis_name, "MultiSteps")
        self._opt = optax.with_extra_args_support(opt)
        self._every_k_schedule = check_schedule(every_k_schedule)
        self._use_grad_mean = use_grad_mean
        self._should_skip_update_fn = should_skip_update_fn or never_skip
        check_accum_dtype("accumulator_dtype", accumulator_dtype)
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
            acc_grads=zero_accumulator(params, self._accumulator_dtype),
            skip_state=skip_state,
            acc_weight=jnp.zeros([], jnp.float32),
            noise=_window_noise.init_window_noise() if self._track_noise_scale else (),
            loss_scale=_loss_scale.first_window(self._loss_scale),
            metadata=() if metadata is None else window_metadata(metadata),
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
            weight = check_weight(weight)
        metadata = check_metadata(state, extra_args.pop("metadata", None))
        every_k = window_length(self._every_k_schedule, state.gradient_step, every_k)
        grads, call_finite = updates, None
        if self._loss_scale is not None:
            grads, call_finite = unscaled_call(
                updates, window_scale(self._loss_scale, state, "update"), weight
            )
        should_skip, skip_state = call_skipped(
            self._should_skip_update_fn, grads, state.gradient_step, params, weight
        )
        should_skip, closes, emit, loss_scale = verdict(
            state, should_skip, call_finite, every_k
        )
        sums = add_call(grads, state, weight, should_skip)

        def emit_window(acc_grads, inner_opt_state):
            grads = acc_grads
            if self._use_grad_mean:
                grads = divide_by_total_weight(acc_grads, sums.acc_weight)
            return inner_update(
                self._opt, grads, inner_opt_state, updates, params, extra_args
            )

        new_updates, inner_opt_state, sums = close_or_carry(
            emit, sums, state.inner_opt_state, emit_window
        )
        mini_step, gradient_step = counters(state, closes, should_skip, emit)
        new_state = MultiStepsState(
            mini_step,
            gradient_step,
            inner_opt_state,
            sums.acc_grads,
            skip_state,
            sums.acc_weight,
            sums.noise,
            loss_scale,
            max_into_window(state, metadata, should_skip),
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
        return next_metadata(state, current, self.has_updated(state))

    def loss_scale(self, state: MultiStepsState) -> jax.Array:
        """The scale to multiply this call's loss by: the current window's, a
        float32 scalar, the same for every call of a window (an example:
        [Mixed precision](../guides/mixed-precision.md#across-calls-multisteps)).

        Raises:
          ValueError: for a `MultiSteps` built without ``loss_scale``.
        """
        return window_scale(self._loss_scale, state, "loss_scale").scale.loss_scale

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
