"""In-step accumulation: ``value_and_grad`` over micro-batches in one ``lax.scan``."""

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from typing_extensions import Unpack

from jaxaccum import _split
from jaxaccum._fsdp import shard_plan
from jaxaccum._loss_scale import (
    loss_scale_report,
    pop_loss_scale,
    scale_loss,
    select_if_finite,
)
from jaxaccum._noise_scale import window_stats
from jaxaccum._options import (
    SHARD_OPTIONS,
    AccumOptions,
    check_accepts_example_mask,
    check_scalar,
)
from jaxaccum._types import AccumKwargs, Fun, PyTree
from jaxaccum._window import (
    FiniteReport,
    MicroOut,
    MicroResult,
    Window,
    WindowOut,
    aux_pair,
    microbatch_share,
    weighted_pair,
    zeros_like_aval,
)


def value_and_grad(
    fun: Fun,
    num_microbatches: int | None = None,
    **options: Unpack[AccumKwargs],
) -> Fun:
    """Returns a function computing ``fun``'s value and gradient by micro-batches.

    Equal to ``jax.value_and_grad(fun)`` on the whole batch, one micro-batch at
    a time in one ``jax.lax.scan``. Guide: [In-step](../guides/in-step.md).

    Args:
      fun: the loss, ``fun(*args, **kwargs)``: a scalar (``(loss, aux)`` with
        ``has_aux``; ``(loss_sum, weight)`` with ``reduction="weighted"``).
      num_microbatches: ``N``; must divide the batch size (unless ``pad``).
        Exactly one of it and ``microbatch_size``.
      **options: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch, instead of ``N``.
      argnums: positional argument(s) to differentiate; their leaves are floats.
      batch_argnums: positional argument(s) holding the batch, split on axis 0.
      key_argnums: positional argument(s) holding PRNG keys, split per micro-batch.
      state_argnums: positional argument(s) holding state that ``fun`` returns
        updated, ``(out, new_state)``; carried in order, not differentiated.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: ``fun``'s loss over its batch: ``"mean"``, ``"sum"`` or
        ``"weighted"`` (``sum(loss_sum) / sum(weight)``; 0 at weight 0).
      aux_reduction: ``"mean"``, ``"sum"``, ``"stack"``, ``"concat"`` or
        ``"last"``, or a pytree prefix of the aux output mapping leaves to them.
      accum_dtype: dtype float gradients accumulate in (at least); ``None``
        keeps each gradient's own dtype. Results come back in their own dtype.
      pad: pad a batch that ``N`` does not divide; ``fun`` then takes
        ``example_mask=``, and ``reduction`` is ``"weighted"`` or ``"sum"``.
      unroll: passed to ``jax.lax.scan``.
      remat: ``True`` or a checkpoint policy: ``jax.checkpoint`` the loss.
      report_finite: also return a :class:`FiniteReport`.
      report_stats: also return a :class:`WindowStats` (the noise scale).
      masked: ``N`` is a maximum: the call's ``active_microbatches`` (traced
        under ``jit``) says how many micro-batches one program computes.
      loss_scale: the call's ``loss_scale=`` (a :class:`DynamicLossScale`)
        scales every micro-batch's loss; the gradients come back unscaled and
        the report is a :class:`LossScaleReport` (finite, the next scale).
        Guide: [Mixed precision](../guides/mixed-precision.md).

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``
      (``((value, aux), grads)`` with ``has_aux``), ``grads`` like
      ``args[argnums]``; with ``state_argnums``, ``(that, new_state)``; with
      ``report_finite``, ``report_stats`` or ``loss_scale``, ``(all that,
      report)``.

    Raises:
      TypeError: for an unknown or ill-typed option or non-float ``argnums``.
      ValueError: for an option out of range or a batch ``N`` does not divide.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def loss(params, batch):
      ...     return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> step = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))
      >>> step(jnp.ones(3), batch)
      (Array(9., dtype=float32), Array([6., 6., 6.], dtype=float32))
    """
    return make_accumulated(
        fun,
        AccumOptions.create(
            "value_and_grad", num_microbatches, options, refused=SHARD_OPTIONS
        ),
    )


def grad(
    fun: Fun, num_microbatches: int | None = None, **options: Unpack[AccumKwargs]
) -> Fun:
    """Like :func:`value_and_grad` but returns only the gradient.

    With ``has_aux=True`` returns ``(grads, aux)``, as ``jax.grad`` does; with
    ``state_argnums``, ``(that, new_state)``; with ``report_finite``
    (``report_stats``, ``loss_scale``), all that and the :class:`FiniteReport`
    (:class:`WindowStats`, :class:`LossScaleReport`).

    Args:
      fun: the loss, as for :func:`value_and_grad`: a scalar mean (or sum, or
        ``(sum, weight)``) over the examples of the batch it is given.
      num_microbatches: N, the number of micro-batches the batch is split into
        (or give ``microbatch_size``).
      **options: :func:`value_and_grad`'s keyword options, with the same
        meaning (``microbatch_size``, ``argnums``, ``batch_argnums``,
        ``has_aux``, ``reduction``, ...).

    Returns:
      A function of ``fun``'s arguments that returns the gradient of the whole
      batch's loss with respect to ``argnums``, computed one micro-batch at a
      time in one ``jax.lax.scan``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> jaxaccum.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.ones((4, 2)))
      Array([1., 1.], dtype=float32)
    """
    accum_options = AccumOptions.create(
        "grad", num_microbatches, options, refused=SHARD_OPTIONS
    )
    return grads_only(make_accumulated(fun, accum_options), accum_options)


def grads_only(value_and_grad_fun: Fun, options: AccumOptions) -> Fun:
    """``value_and_grad_fun`` returning what ``jax.grad`` would: the gradients
    (``(grads, aux)`` with ``has_aux``), then the new state and the report."""

    def only_grads(out):
        result, new_state = out if options.state_nums else (out, None)
        value_or_pair, grads = result
        grads = (grads, value_or_pair[1]) if options.has_aux else grads
        return (grads, new_state) if options.state_nums else grads

    @functools.wraps(value_and_grad_fun)
    def grad_fun(*args: PyTree, **call_kwargs: PyTree) -> PyTree:
        out = value_and_grad_fun(*args, **call_kwargs)
        if options.reports:
            return only_grads(out[0]), out[1]
        return only_grads(out)

    return grad_fun


class _Inputs(NamedTuple):
    """The window's arguments by role (each a tuple in argument order), the
    call's ``active_microbatches`` and loss scale (float32) where given."""

    diff: tuple
    batch: tuple
    keys: tuple
    state: tuple
    example_mask: jax.Array | None
    active: jax.Array | None = None
    loss_scale: jax.Array | None = None


def make_accumulated(fun: Fun, options: AccumOptions) -> Fun:
    """``fun`` accumulated as ``options`` say: the core of every front end.

    With ``options.data_axes`` (manual mesh axes the batch is split over, inside
    ``shard_map``), each device accumulates the sums of its own rows and they
    are all-reduced once, after the micro-batch loop; parameters and keys are
    prepared per device.
    """
    if options.pad:
        check_accepts_example_mask(fun)

    @functools.wraps(fun)
    def accumulated(*args: PyTree, **kwargs: PyTree) -> PyTree:
        active = _pop_active_microbatches(kwargs, options)
        scale = pop_loss_scale(kwargs, options.loss_scale)
        check_arg_count(args, options)
        labelled_batches = [(f"args[{i}]", args[i]) for i in options.batch_nums]
        split = _split.resolve_num_microbatches(
            _split.batch_size_of(labelled_batches),
            options.num_microbatches,
            options.microbatch_size,
            pad=options.pad,
        )
        valid = None
        if active is not None:
            valid = _check_active_microbatches(active, split.num_microbatches)
            active = jnp.asarray(active, jnp.int32)
        if split.num_microbatches > 1:
            _split.check_sharded_split(
                labelled_batches, split.padded_size, split.num_microbatches
            )
        _check_differentiable(args, options.diff_nums)
        loss_scale = None if scale is None else scale.loss_scale
        micro = _micro_value_and_grad(fun, args, kwargs, options, loss_scale)
        inputs = _inputs(args, options, split, active)._replace(loss_scale=loss_scale)
        run = _single if split.num_microbatches == 1 else _scan
        out = run(micro, inputs, options, split)
        if scale is not None and options.state_nums:
            # A window the scale skips leaves the carried state as it was,
            # on every front end that writes it back (NNX in place).
            finite = typing.cast(jax.Array, out.result.finite)
            kept = select_if_finite(finite, out.new_state, inputs.state)
            out = out._replace(new_state=kept)
        return _package(out, options, valid, scale)

    add_call_parameters(accumulated, fun, options)
    return accumulated


def add_call_parameters(accumulated: Fun, fun: Fun, options: AccumOptions) -> None:
    """Gives ``accumulated`` ``fun``'s signature plus the keyword-only
    arguments ``options`` make it take per call (``active_microbatches``
    with ``masked``, ``loss_scale`` with ``loss_scale``), so that wrappers
    which bind the signature (``eqx.filter_jit``) accept them;
    ``functools.wraps`` alone would give it ``fun``'s, without them."""
    names = {"active_microbatches": options.masked, "loss_scale": options.loss_scale}
    wanted = [name for name, taken in names.items() if taken]
    if not wanted:
        return
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):  # no signature to read (a C function)
        return
    parameters = list(signature.parameters.values())
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    parameters[at:at] = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)
        for name in wanted
        if name not in signature.parameters
    ]
    accumulated.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters
    )


def _pop_active_microbatches(kwargs: dict, options: AccumOptions) -> Any:
    """With ``masked``, the call's ``active_microbatches``, popped from
    ``kwargs`` (``fun`` never sees it); without, a refusal if it is passed."""
    if not options.masked:
        if "active_microbatches" in kwargs:
            raise TypeError(
                "active_microbatches was passed to a function built without "
                "masked=True: it would reach fun as a keyword argument (or "
                "be lost in its **kwargs) and every micro-batch would be "
                "computed. Build the function with masked=True to compute "
                "only the first active_microbatches micro-batches."
            )
        return None
    if "active_microbatches" not in kwargs:
        raise TypeError(
            "With masked=True, call the accumulated function with the keyword "
            "argument active_microbatches: how many of the window's "
            "micro-batches to compute (an int, traced under jit)."
        )
    return kwargs.pop("active_microbatches")


def _check_active_microbatches(active: Any, num_microbatches: int) -> Any:
    """Checks ``active_microbatches`` against the window's ``N``. Returns
    None where it is concrete (and checked), else the traced flag that it is
    in range, which :func:`_package` turns into NaN outputs when false."""
    check_scalar(
        "active_microbatches",
        active,
        integer=True,
        low=1,
        high=num_microbatches,
        hint="It counts the micro-batches of the window to compute: from 1 to "
        f"the window's N = {num_microbatches}.",
    )
    if not isinstance(active, jax.core.Tracer):
        return None
    return (active >= 1) & (active <= num_microbatches)


def check_arg_count(args: tuple, options: AccumOptions) -> None:
    needed = max(options.all_nums) + 1
    if len(args) < needed:
        used = ", ".join(
            f"{name}={nums}" for name, nums in options.roles.items() if nums
        )
        raise TypeError(
            f"The accumulated function needs at least {needed} positional "
            f"arguments ({used}), got {len(args)}."
        )


def _check_differentiable(args: tuple, argnums: tuple[int, ...]) -> None:
    for num in argnums:
        check_differentiable(
            f"args[{num}]",
            args[num],
            "or pass it in an argument that is not in argnums.",
        )


def check_differentiable(label: str, tree: PyTree, fix: str) -> None:
    """Every leaf of the differentiated ``tree`` (named ``label``) is float
    or complex; else a TypeError naming the leaf, ending with ``fix``."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"Differentiated leaf {label}{jax.tree_util.keystr(path)} "
                f"has dtype {dtype}; gradients need float (or complex) "
                f"leaves. Cast it to a float dtype, {fix}"
            )


def _micro_value_and_grad(
    fun: Fun,
    args: tuple,
    kwargs: dict,
    options: AccumOptions,
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
        if not hasattr(loss, "dtype") and not isinstance(loss, float | int):
            raise TypeError(
                "fun must return a scalar loss (a pair (loss, aux) with "
                "has_aux=True; (loss_sum, weight) with reduction='weighted'); "
                f"got a {type(loss).__name__}."
            )
        share = microbatch_share(options, num_means, weight)
        differentiated = loss * share.astype(jnp.result_type(loss))
        if loss_scale is not None:
            differentiated = scale_loss(differentiated, loss_scale)
        return differentiated, (loss, share, MicroOut(weight, aux, tuple(new_state)))

    if options.remat:
        policy = None if isinstance(options.remat, bool) else options.remat
        micro_loss = jax.checkpoint(micro_loss, policy=policy)
    value_and_grad_fun = jax.value_and_grad(micro_loss, has_aux=True)

    def micro(diff, batch, keys, state, example_mask, num_means) -> MicroResult:
        # Named so that a profiler trace shows where a window's time goes.
        with jax.named_scope("jaxaccum_microbatch"):
            (_, (value, share, out)), grads = value_and_grad_fun(
                diff, batch, keys, state, example_mask, num_means
            )
        return MicroResult(value, out, grads, share)

    return micro


def _inputs(
    args: tuple, options: AccumOptions, split: _split.Split, active: Any = None
) -> _Inputs:
    """The window's arguments by role; the batch padded, keys per device."""
    diff = tuple(args[i] for i in options.diff_nums)
    keys = tuple(args[i] for i in options.key_nums)
    shards = shard_plan(options)
    if shards is not None:
        keys = _fold_device_index(keys, options.data_axes)
        diff = shards.gather(shards.varying(diff), in_window=True)
    batch = _split.pad_batch(
        tuple(args[i] for i in options.batch_nums), split.padded_size
    )
    example_mask = None
    if options.pad:
        example_mask = jnp.arange(split.padded_size) < split.batch_size
    state = tuple(args[i] for i in options.state_nums)
    return _Inputs(diff, batch, keys, state, example_mask, active)


def _fold_device_index(key_vals: tuple, data_axes: tuple[str, ...]) -> tuple:
    """Keys folded with the device's index, so that devices draw independent
    randomness for their rows."""
    device_index = lax.axis_index(data_axes)
    return jax.tree.map(lambda key: jax.random.fold_in(key, device_index), key_vals)


def _check_state(state_vals: tuple, new_state: tuple, state_nums: tuple) -> None:
    """The state fun returns must have the structure, shapes and dtypes it got."""
    for num, before, after in zip(state_nums, state_vals, new_state, strict=True):
        old_tree: Any  # a PyTreeDef, which jaxlib's stubs leave unresolved
        new_tree: Any
        old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(before)
        new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(after)
        if old_tree != new_tree:
            raise ValueError(
                f"The new state fun returns for args[{num}] has structure "
                f"{new_tree}, but the state passed in has {old_tree}. Return the "
                "updated state with the same structure as the state argument."
            )
        for (path, old), (_, new) in zip(old_leaves, new_leaves, strict=True):
            old_spec = (jnp.shape(old), jnp.result_type(old))
            new_spec = (jnp.shape(new), jnp.result_type(new))
            if old_spec != new_spec:
                raise ValueError(
                    f"State leaf args[{num}]{jax.tree_util.keystr(path)} comes "
                    f"back from fun with shape {new_spec[0]} and dtype "
                    f"{new_spec[1]}, but went in with shape {old_spec[0]} and "
                    f"dtype {old_spec[1]}; it is carried from one micro-batch to "
                    "the next, so both must be the same."
                )


def _window(
    result_shape: MicroResult,
    inputs: _Inputs,
    options: AccumOptions,
    split: _split.Split,
) -> Window:
    """The window of both paths, once the state ``fun`` returns is checked."""
    _check_state(inputs.state, result_shape.out.new_state, options.state_nums)
    return Window(result_shape, options, split, inputs.loss_scale)


def _single(
    micro: Callable[..., MicroResult],
    inputs: _Inputs,
    options: AccumOptions,
    split: _split.Split,
) -> WindowOut:
    """One micro-batch, no scan, the key passed unchanged: jax.value_and_grad."""
    result = micro(
        _gathered(inputs.diff, options),
        inputs.batch,
        inputs.keys,
        inputs.state,
        inputs.example_mask,
        _num_means(options, 1),
    )
    window = _window(jax.eval_shape(lambda: result), inputs, options, split)
    sums, stacked = window.add(window.zeros(), result)
    micro_stats = window.micro_stats(result, inputs.example_mask)
    return WindowOut(
        window.result(sums, [x[None] for x in stacked]),
        result.out.new_state,
        jax.tree.map(lambda x: x[None], micro_stats),
    )


def _scan(
    micro: Callable[..., MicroResult],
    inputs: _Inputs,
    options: AccumOptions,
    split: _split.Split,
) -> WindowOut:
    """The micro-batches in one scan over a strided view of the batch."""
    num = split.num_microbatches
    batch = _split.strided_batch(inputs.batch, num)
    mask_view = None
    if inputs.example_mask is not None:
        mask_view = _split.strided_view(inputs.example_mask, num)
    keys = jax.tree.map(lambda key: jax.random.split(key, num), inputs.keys)

    def mask_at(index):
        return None if mask_view is None else _split.take_microbatch(mask_view, index)

    num_means = _num_means(options, num if inputs.active is None else inputs.active)

    def micro_at(index, micro_keys, state, mask):
        micro_batch = batch.microbatch(index)
        diff = _gathered(inputs.diff, options, index)
        return micro(diff, micro_batch, micro_keys, state, mask, num_means)

    first_keys = jax.tree.map(lambda k: k[0], keys)
    first = jnp.zeros((), jnp.int32)
    result_shape = jax.eval_shape(
        micro_at, first, first_keys, inputs.state, mask_at(first)
    )
    window = _window(result_shape, inputs, options, split)

    def body(carry, xs):
        sums, state = carry
        index, micro_keys = xs
        mask = mask_at(index)
        result = micro_at(index, micro_keys, state, mask)
        sums, stacked = window.add(sums, result)
        micro_stats = window.micro_stats(result, mask)
        return (sums, result.out.new_state), (stacked, micro_stats)

    carry = (window.zeros(), inputs.state)
    if inputs.active is not None:
        body = _skip_inactive(body, carry, (first, first_keys), inputs.active)
    (sums, state), (stacked, micro_stats) = lax.scan(
        body, carry, (jnp.arange(num), keys), unroll=options.unroll
    )
    result = window.result(sums, stacked, num_active=inputs.active)
    return WindowOut(result, state, micro_stats)


def _num_means(options: AccumOptions, num_microbatches: Any) -> Any:
    """The window's micro-batches over every device (a mean divides by it)."""
    if options.data_axes:
        return num_microbatches * lax.axis_size(options.data_axes)
    return num_microbatches


def _skip_inactive(body: Fun, carry: PyTree, xs: PyTree, active: jax.Array) -> Fun:
    """``body`` for micro-batches below ``active``; above it, the carry
    unchanged and zeros out (weight 0, finite), not computed."""
    out_shape = jax.eval_shape(body, carry, xs)[1]

    def skipped(carry, xs):
        del xs
        # Sharded like the computed branch's outputs under an Explicit mesh.
        zeros = jax.tree.map(lambda aval: zeros_like_aval(aval, aval.dtype), out_shape)
        stacked, micro_stats = zeros
        finite = jnp.ones_like(micro_stats.finite)
        return carry, (stacked, micro_stats._replace(finite=finite))

    def masked_body(carry, xs):
        return lax.cond(xs[0] < active, body, skipped, carry, xs)

    return masked_body


def _gathered(diff: tuple, options: AccumOptions, index: Any = None) -> tuple:
    """The parameters micro-batch ``index`` sees: those sharded over the data
    axes and gathered per micro-batch are gathered here, inside the loop."""
    shards = shard_plan(options, index)
    return diff if shards is None else shards.gather(diff, in_window=False)


def _invalid_unless(valid: jax.Array | None, tree: PyTree) -> Any:
    """``tree`` where ``valid`` (traced) holds, else no plausible number: NaN
    in float leaves, False in bool ones (the finite flags), the dtype's most
    negative value in integer ones (its largest if unsigned)."""
    if valid is None:
        return tree

    def invalid(leaf: PyTree) -> Any:
        leaf = jnp.asarray(leaf)
        dtype = leaf.dtype
        if jnp.issubdtype(dtype, jnp.inexact):
            bad = jnp.nan
        elif jnp.issubdtype(dtype, jnp.bool_):
            bad = False
        elif jnp.issubdtype(dtype, jnp.signedinteger):
            bad = jnp.iinfo(dtype).min
        elif jnp.issubdtype(dtype, jnp.unsignedinteger):
            bad = jnp.iinfo(dtype).max
        else:  # PRNG keys: nothing to poison
            return leaf
        return jnp.where(valid, leaf, jnp.asarray(bad, dtype))

    return jax.tree.map(invalid, tree)


def _package(
    out: WindowOut, options: AccumOptions, valid: Any = None, scale: Any = None
) -> PyTree:
    """The window's result in the layout ``value_and_grad`` documents;
    ``valid`` (traced, for ``masked``) false makes the value, aux, gradients
    and report invalid (see :func:`_invalid_unless`), the new state aside;
    ``scale``, the call's :class:`DynamicLossScale` (with ``loss_scale``),
    makes the report a :class:`LossScaleReport`."""
    value, aux, grads, grad_sq_norm, finite = out.result
    value, aux, grads = _invalid_unless(valid, (value, aux, grads))
    grads = grads[0] if isinstance(options.argnums, int) else grads
    result = ((value, aux), grads) if options.has_aux else (value, grads)
    if options.state_nums:
        new_state = out.new_state
        if isinstance(options.state_argnums, int):
            new_state = new_state[0]
        result = result, new_state
    report: Any = ()
    if options.report_stats:
        stats = window_stats(
            out.micro,
            typing.cast(jax.Array, grad_sq_norm),  # computed with report_stats
            options.reduction,
            options.data_axes,
        )
        report = _invalid_unless(valid, stats)
    elif options.report_finite:
        flags = out.micro.finite
        report = _invalid_unless(valid, FiniteReport(flags, jnp.all(flags)))
    if options.loss_scale:
        report = loss_scale_report(typing.cast(jax.Array, finite), scale, valid, report)
    return (result, report) if options.reports else result
