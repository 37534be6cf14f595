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
"""

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxaccum._noise_scale import NoiseEstimates, estimate
from jaxaccum._reduce import divide_by_total_weight

EveryKSchedule = int | Callable[[jax.Array], jax.typing.ArrayLike]


class MultiStepsState(NamedTuple):
    """State of `MultiSteps`; the fields of `optax.MultiStepsState` plus one.

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
      acc_sq_norm: with ``track_noise_scale``, float32 ``(2,)``: the window's
        sum of ``weight * |gradient|^2`` over calls (reset like ``acc_grads``)
        and the squared norm of the last emitted window's mean gradient;
        ``()`` without.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    inner_opt_state: Any
    acc_grads: Any
    skip_state: Any = ()
    acc_weight: jax.Array | float = 0.0
    acc_sq_norm: Any = ()


def _never_skip(
    updates: optax.Updates,
    gradient_step: jax.typing.ArrayLike,
    params: optax.Params | None,
) -> tuple[jax.Array, Any]:
    del updates, gradient_step, params
    return jnp.array(False), ()


def _check_every_k(every_k: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
    """Rejects schedules whose value is not an integer scalar."""
    dtype, shape = jnp.result_type(every_k), jnp.shape(every_k)
    if not jnp.issubdtype(dtype, jnp.integer) or shape != ():
        raise TypeError(
            "every_k_schedule(gradient_step) must return an integer scalar, got "
            f"dtype {dtype} and shape {shape}. Return e.g. "
            "jnp.where(gradient_step < 100, 1, 4)."
        )
    return every_k


def _check_weight(weight: Any) -> jax.Array:
    """Returns ``weight`` as a float32 scalar, or raises saying what is wrong."""
    try:
        weight = jnp.asarray(weight)
    except TypeError as error:
        raise TypeError(
            f"weight must be a scalar number or array, got {type(weight).__name__}."
            " Pass the micro-batch's number of tokens (or examples) as a scalar."
        ) from error
    if weight.shape != ():
        raise ValueError(
            f"weight must be a scalar (shape ()), got shape {weight.shape}. "
            "Pass the micro-batch's total weight, e.g. mask.sum(), not the "
            "per-example weights."
        )
    if not jnp.issubdtype(weight.dtype, jnp.number):
        raise TypeError(
            f"weight must be numeric, got dtype {weight.dtype}. "
            "Pass e.g. mask.sum() or a float."
        )
    return weight.astype(jnp.float32)


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
    the token-exact window mean ``sum(w * g) / sum(w)``; it is not forwarded to
    the wrapped optimizer. Other extra arguments (``value``, ``value_fn``,
    ...) are forwarded to it on the emitting call.

    For speed, jit the whole train step (``update`` then
    ``optax.apply_updates``) with the params and the optimizer state donated,
    ``jax.jit(step, donate_argnums=(0, 1))``. Then a mid-window call is one
    pass that adds the gradient into the accumulator in place and one that
    adds the (zero) updates to the params in place; the inner state passes
    through the ``lax.cond`` untouched, and nothing parameter-sized is
    allocated: on 12M float32 Adam parameters it costs 0.16-0.24x of
    ``optax.MultiSteps`` in optax's fastest configuration (which is without
    donation: donating makes optax's step ~2.3x slower on XLA CPU), and the
    emitting call 0.67-0.91x. Without donation every output needs a fresh
    buffer and XLA copies the inner state before the ``cond``: mid-window
    0.60-0.92x, the emitting call ~1.25x (it reads ``mu`` and ``nu`` twice).
    If you jit ``update`` alone, donate the gradients together with the
    state: JAX pairs donated inputs with outputs of the same shape in order,
    and ``updates`` comes first. Figures: ``benchmarks/README.md``. Under
    `jax.vmap` with a batched state, `jax.lax.cond` becomes a select, so
    every call pays for the wrapped update; results are the same.

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
        every_k_schedule: EveryKSchedule,
        use_grad_mean: bool = True,
        should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
        accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
        track_noise_scale: bool = False,
    ):
        """Initializer.

        Args:
          opt: the wrapped optimizer.
          every_k_schedule: calls per window; an int >= 1, or a function of the
            int32 ``gradient_step`` returning an integer scalar (a batch-size
            ramp). It is evaluated once per window, so it may change between
            windows only.
          use_grad_mean: if True (default), emit the window's weighted mean
            gradient ``sum(w * g) / sum(w)`` (``w = 1`` without ``weight``);
            otherwise emit the sum ``sum(w * g)``.
          should_skip_update_fn: optional function with the signature of
            ``optax.skip_not_finite`` (or ``functools.partial`` of
            ``optax.skip_large_updates``). A call it rejects leaves every field
            of the state except ``skip_state`` bitwise unchanged and returns
            zeros.
          accumulator_dtype: dtype of ``acc_grads``; float32 by default, so that
            bfloat16 / float16 gradients are summed in float32. None uses the
            params' dtype.
          track_noise_scale: keep one more float32 scalar in the state, the
            window's sum of squared call-gradient norms, from which
            :meth:`noise_estimates` gives the gradient noise scale after each
            emitting call.
        """
        if not callable(every_k_schedule):
            if isinstance(every_k_schedule, bool) or not isinstance(
                every_k_schedule, numbers.Integral
            ):
                raise TypeError(
                    "every_k_schedule must be an int or a function of "
                    f"gradient_step, got {type(every_k_schedule).__name__}."
                )
            every_k_schedule = int(every_k_schedule)
            if every_k_schedule < 1:
                raise ValueError(
                    f"every_k_schedule must be >= 1 calls per window, got "
                    f"{every_k_schedule}. Use 1 to step on every call."
                )
        self._opt = optax.with_extra_args_support(opt)
        self._every_k_schedule = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._should_skip_update_fn = should_skip_update_fn or _never_skip
        self._accumulator_dtype = accumulator_dtype
        self._track_noise_scale = track_noise_scale

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer, with extra-args support."""
        return self._opt

    def _every_k(self, gradient_step: jax.Array) -> jax.typing.ArrayLike:
        if isinstance(self._every_k_schedule, int):
            return self._every_k_schedule
        return _check_every_k(self._every_k_schedule(gradient_step))

    def init(self, params: optax.Params) -> MultiStepsState:
        """Returns the state at the start of the first window.

        Args:
          params: the parameters the wrapped optimizer is initialised with.

        Returns:
          A `MultiStepsState` with zero counters and accumulator.
        """
        gradient_step = jnp.zeros([], jnp.int32)
        _, skip_state = self._should_skip_update_fn(
            optax.tree.zeros_like(params), gradient_step, params
        )
        return MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=self._opt.init(params),
            acc_grads=optax.tree.zeros_like(params, dtype=self._accumulator_dtype),
            skip_state=skip_state,
            acc_weight=jnp.zeros([], jnp.float32),
            acc_sq_norm=jnp.zeros([2], jnp.float32) if self._track_noise_scale else (),
        )

    def update(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MultiStepsState]:
        """Accumulates ``updates``; returns the wrapped optimizer's on a window's end.

        Args:
          updates: this call's gradients, a pytree like the params.
          state: the state from `init` or the previous call.
          params: the current params, forwarded to the wrapped optimizer.
          **extra_args: ``weight`` (optional scalar, this call's share of the
            window mean, e.g. its token count; default 1), and any extra
            arguments of the wrapped optimizer, forwarded on emitting calls.

        Returns:
          ``(updates, new_state)``: exact zeros mid-window, the wrapped
          optimizer's updates on the emitting call, with the dtypes the wrapped
          optimizer gives in both cases.
        """
        weight = extra_args.pop("weight", None)
        if weight is not None:
            weight = _check_weight(weight)
        every_k = self._every_k(state.gradient_step)
        should_skip, skip_state = self._should_skip(updates, state, params, weight)
        emit = jnp.logical_and(~should_skip, state.mini_step + 1 >= every_k)
        acc_grads, acc_weight, running_sq_norm = self._add(
            updates, state, weight, should_skip
        )

        def emit_window(acc_grads, inner_opt_state):
            return self._emit(
                acc_grads, acc_weight, inner_opt_state, updates, params, extra_args
            )

        def emit_into_accumulator(acc_grads, inner_opt_state):
            # The window's sum is dead once the inner optimizer has read it:
            # its buffer carries the updates out of the cond (see below).
            new_updates, new_inner_state = emit_window(acc_grads, inner_opt_state)
            carried = jax.tree.map(
                lambda update, acc: update.astype(acc.dtype), new_updates, acc_grads
            )
            return carried, new_inner_state, self._window_sq_norm(acc_grads, acc_weight)

        def mid_window(acc_grads, inner_opt_state):
            last = state.acc_sq_norm[1] if self._track_noise_scale else ()
            return acc_grads, inner_opt_state, last

        # Mid-window the accumulator and the inner state pass through the cond
        # untouched; with the state donated, XLA keeps both in place. The
        # updates are selected outside the cond, from the accumulator's buffer:
        # a cond output of their own would be a parameter-sized temporary, freshly
        # allocated (and page-faulted) by every call, while a select fuses into
        # the caller's `params + updates`.
        update_shapes, _ = jax.eval_shape(emit_window, acc_grads, state.inner_opt_state)
        acc_grads, inner_opt_state, window_sq_norm = jax.lax.cond(
            emit, emit_into_accumulator, mid_window, acc_grads, state.inner_opt_state
        )
        acc_sq_norm = state.acc_sq_norm
        if self._track_noise_scale:
            acc_sq_norm = jnp.stack([running_sq_norm, window_sq_norm])
        new_updates = jax.tree.map(
            lambda acc, shape: jnp.where(
                emit, acc.astype(shape.dtype), jnp.zeros((), shape.dtype)
            ),
            acc_grads,
            update_shapes,
        )
        new_state = MultiStepsState(
            mini_step=jnp.where(
                emit, 0, jnp.where(should_skip, state.mini_step, state.mini_step + 1)
            ).astype(jnp.int32),
            gradient_step=jnp.where(
                emit, optax.safe_increment(state.gradient_step), state.gradient_step
            ),
            inner_opt_state=inner_opt_state,
            acc_grads=acc_grads,
            skip_state=skip_state,
            acc_weight=acc_weight,
            acc_sq_norm=acc_sq_norm,
        )
        return new_updates, new_state

    def _add(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        weight: jax.Array | None,
        should_skip: jax.Array,
    ) -> tuple[Any, jax.Array, Any]:
        """This call's share of the window: the new accumulator, total weight
        and (with ``track_noise_scale``) sum of squared gradient norms."""
        # The reset is lazy: the first accepted call of a window overwrites the
        # previous window's sum instead of an extra pass writing zeros.
        window_start = state.mini_step == 0

        def add_to_window(acc: jax.Array, grad: jax.Array) -> jax.Array:
            grad = grad.astype(acc.dtype)
            if weight is not None:
                grad = weight.astype(acc.dtype) * grad
            new_sum = jnp.where(window_start, grad, acc + grad)
            # Selects, not branches: they fuse into the add's single pass.
            return jnp.where(should_skip, acc, new_sum)

        acc_grads = jax.tree.map(add_to_window, state.acc_grads, updates)
        acc_weight = add_to_window(
            jnp.asarray(state.acc_weight, jnp.float32), jnp.ones([], jnp.float32)
        )
        running_sq_norm: Any = ()
        if self._track_noise_scale:
            sq_norm = optax.tree.norm(
                jax.tree.map(lambda g: g.astype(jnp.float32), updates), squared=True
            )
            running_sq_norm = add_to_window(state.acc_sq_norm[0], sq_norm)
        return acc_grads, acc_weight, running_sq_norm

    def _window_sq_norm(self, acc_grads: Any, acc_weight: jax.Array) -> Any:
        """With ``track_noise_scale``, ``|G_B|^2`` of the window's mean gradient."""
        if not self._track_noise_scale:
            return ()
        mean = divide_by_total_weight(
            jax.tree.map(lambda acc: acc.astype(jnp.float32), acc_grads), acc_weight
        )
        return optax.tree.norm(mean, squared=True)

    def _should_skip(
        self,
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None,
        weight: jax.Array | None,
    ) -> tuple[jax.Array, Any]:
        """Whether to drop this call, and the skip function's state."""
        should_skip, skip_state = self._should_skip_update_fn(
            updates, state.gradient_step, params
        )
        should_skip = jnp.asarray(should_skip)
        if (should_skip.dtype, should_skip.shape) != (jnp.bool_, ()):
            raise ValueError(
                "should_skip_update_fn must return a boolean scalar first, got "
                f"dtype {should_skip.dtype} and shape {should_skip.shape}."
            )
        if weight is not None and self._should_skip_update_fn is not _never_skip:
            # The skip function sees only the gradient; a NaN or inf weight
            # would poison the window just the same.
            should_skip = should_skip | ~jnp.isfinite(weight)
        return should_skip, skip_state

    def _emit(
        self,
        acc_grads: Any,
        acc_weight: jax.Array,
        inner_opt_state: Any,
        updates: optax.Updates,
        params: optax.Params | None,
        extra_args: dict[str, Any],
    ) -> tuple[optax.Updates, Any]:
        """The emitting call: the wrapped optimizer on the window's gradient."""
        grads = acc_grads
        if self._use_grad_mean:
            grads = divide_by_total_weight(acc_grads, acc_weight)
        new_updates, new_inner_state = self._opt.update(
            optax.tree.cast_like(grads, updates), inner_opt_state, params, **extra_args
        )
        # Both branches must return the same dtypes; keep the state's (as
        # optax does), which also keeps it stable as a lax.scan carry.
        new_inner_state = jax.tree.map(
            lambda new, old: new if new.dtype == old.dtype else new.astype(old.dtype),
            new_inner_state,
            inner_opt_state,
        )
        return new_updates, new_inner_state

    def has_updated(self, state: MultiStepsState | Any) -> jax.Array:
        """Returns whether the call that produced ``state`` emitted an update.

        Args:
          state: a `MultiStepsState`.

        Returns:
          A boolean scalar: True right after a window's emitting call.
        """
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

    def noise_estimates(self, state: MultiStepsState) -> NoiseEstimates:
        """The gradient noise scale of the window the last call emitted.

        Needs ``track_noise_scale=True``. Right after an emitting call
        (:meth:`has_updated`) the state still holds the window's sums: the
        ``N`` calls' gradients ``g_k`` (means over their micro-batches, of
        weight ``w_k``: ``weight=``, or 1 per call) and their squared norms
        give the estimates of :class:`jaxaccum.WindowStats` with ``b = W / N``
        and ``B = W`` in the units of ``weight`` (pass ``weight=`` the
        micro-batch's examples or tokens to get ``noise_scale`` in those;
        without it, it counts calls). NaN on other calls.

        Args:
          state: the state an emitting call returned.

        Returns:
          :class:`jaxaccum.NoiseEstimates`: ``gradient_norm_sq``,
          ``gradient_noise_trace`` and ``noise_scale``; fold them into a
          :class:`jaxaccum.NoiseScaleEMA`.
        """
        if not self._track_noise_scale:
            raise ValueError(
                "noise_estimates needs the window's squared norms: build "
                "MultiSteps(..., track_noise_scale=True)."
            )
        total = jnp.asarray(state.acc_weight, jnp.float32)
        safe_total = jnp.where(total > 0, total, 1.0)
        running_sq_norm, window_sq_norm = state.acc_sq_norm
        calls = self._every_k(jnp.maximum(state.gradient_step - 1, 0))
        estimates = estimate(
            running_sq_norm / safe_total,
            window_sq_norm,
            total / jnp.asarray(calls, jnp.float32),
            total,
        )
        nan = jnp.full((), jnp.nan, jnp.float32)
        return jax.tree.map(
            lambda x: jnp.where(self.has_updated(state), x, nan), estimates
        )

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """Returns this wrapper as an ``optax.GradientTransformationExtraArgs``."""
        return optax.GradientTransformationExtraArgs(self.init, self.update)


def accumulate(
    opt: optax.GradientTransformation,
    every_k: EveryKSchedule,
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
    accumulator_dtype: jax.typing.DTypeLike | None = jnp.float32,
    track_noise_scale: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``opt`` to step once per ``every_k`` calls; functional `MultiSteps`.

    Args:
      opt: the wrapped optimizer.
      every_k: calls per window, an int >= 1 or a function of ``gradient_step``.
      use_grad_mean: emit the window's (weighted) mean if True, else its sum.
      should_skip_update_fn: optional, e.g. ``optax.skip_not_finite``.
      accumulator_dtype: dtype of the accumulator, float32 by default.
      track_noise_scale: keep the window's squared gradient norms (see
        :meth:`MultiSteps.noise_estimates`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      `MultiStepsState` and whose ``update`` accepts ``weight=``.

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
    ).gradient_transformation()
