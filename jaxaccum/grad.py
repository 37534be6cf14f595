"""In-step accumulation: ``value_and_grad`` over micro-batches in one ``lax.scan``."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum import split
from jaxaccum._reduce import divide_by_total_weight

Reduction = Literal["mean", "sum", "weighted"]

_REDUCTIONS = ("mean", "sum", "weighted")
_AUX_REDUCTIONS = ("mean", "sum", "stack", "last")


def _as_tuple(name: str, argnums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for num in nums:
        if isinstance(num, bool) or not isinstance(num, int) or num < 0:
            raise TypeError(f"{name} must hold non-negative ints, got {argnums!r}.")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{name} has repeated entries: {argnums!r}.")
    return nums


def _accum_dtype_for(dtype: Any, accum_dtype: Any) -> Any:
    """Float leaves accumulate in at least ``accum_dtype``; others as they are."""
    if accum_dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.promote_types(dtype, accum_dtype)


def _check_differentiable(args: tuple, argnums: tuple[int, ...]) -> None:
    for num in argnums:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args[num]):
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.inexact):
                raise TypeError(
                    f"Differentiated leaf args[{num}]{jax.tree_util.keystr(path)} "
                    f"has dtype {dtype}; gradients need float (or complex) "
                    "leaves. Cast it to a float dtype, or pass it in an argument "
                    "that is not in argnums."
                )


def _split_keys(keys: Any, num_microbatches: int) -> Any:
    return jax.tree.map(lambda key: jax.random.split(key, num_microbatches), keys)


class FiniteReport(NamedTuple):
    """Which micro-batches of a window had a finite loss and gradient.

    Returned by :func:`value_and_grad` with ``report_finite=True``. The flags
    are taken per micro-batch inside the scan, before normalisation, so they
    name the culprit even where the window's result hides it (a window of
    zero total weight returns zeros).

    Attributes:
      microbatch_finite: bool ``(N,)``; entry ``k`` is True when micro-batch
        ``k`` (examples ``k, k + N, ...``) gave a finite loss and gradient.
      finite: bool scalar, all of them: use it to skip the update, e.g. with
        ``jax.lax.cond(report.finite, apply_update, keep, ...)``.
    """

    microbatch_finite: jax.Array
    finite: jax.Array


def _all_finite(out: Any) -> jax.Array:
    """Whether one micro-batch's loss and gradient are all finite."""
    (value, _), grads = out
    leaves = [jnp.asarray(value), *jax.tree.leaves(grads)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def _zeros(shape: Any, dtype: Any) -> jax.Array:
    """Zeros like ``shape`` (an aval), sharded like it under an Explicit mesh.

    There a scan carry's type includes its sharding, so an accumulator must start
    sharded as the gradient it sums (e.g. a parameter sharded over a model axis).
    """
    return jnp.zeros(shape.shape, dtype, out_sharding=split.explicit_sharding(shape))


def _per_device_inputs(
    diff_vals: tuple, key_vals: tuple, data_axes: tuple[str, ...]
) -> tuple[tuple, tuple]:
    """Prepares replicated inputs for a window accumulated per device.

    Parameters are cast to varying over the data axes: differentiating an
    invariant input inside ``shard_map`` would psum its cotangent (the transpose
    of the implicit cast) in every micro-batch's backward pass, which is what
    deferring the reduction avoids. Keys are folded with the device's index so
    devices draw independent randomness for their rows.
    """
    device_index = lax.axis_index(data_axes)
    return lax.pcast(diff_vals, data_axes, to="varying"), jax.tree.map(
        lambda key: jax.random.fold_in(key, device_index), key_vals
    )


class _AuxPlan:
    """Per-leaf aux reductions, broadcast from the user's prefix tree."""

    def __init__(self, aux_reduction: Any, aux_shape: Any, accum_dtype: Any):
        try:
            reductions = jax.tree.broadcast(aux_reduction, aux_shape)
        except ValueError as error:
            raise ValueError(
                "aux_reduction must be one of "
                f"{_AUX_REDUCTIONS} or a pytree prefix of the aux output "
                f"mapping leaves to them; got {aux_reduction!r} for aux of "
                f"structure {jax.tree.structure(aux_shape)}."
            ) from error
        self.leaves, self.treedef = jax.tree.flatten(aux_shape)
        self.reductions = jax.tree.leaves(reductions)
        for reduction in self.reductions:
            if reduction not in _AUX_REDUCTIONS:
                raise ValueError(
                    f"Unknown aux reduction {reduction!r}; use one of "
                    f"{_AUX_REDUCTIONS}."
                )
        self.accum_dtypes = [
            self._carry_dtype(leaf.dtype, reduction, accum_dtype)
            for leaf, reduction in zip(self.leaves, self.reductions, strict=True)
        ]

    @staticmethod
    def _carry_dtype(dtype: Any, reduction: str, accum_dtype: Any) -> Any:
        if reduction == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
            return accum_dtype or jnp.float32
        if reduction in ("mean", "sum"):
            return _accum_dtype_for(dtype, accum_dtype)
        return dtype

    def init(self) -> list:
        return [
            _zeros(leaf, dtype)
            for leaf, reduction, dtype in zip(
                self.leaves, self.reductions, self.accum_dtypes, strict=True
            )
            if reduction != "stack"
        ]

    def update(self, carry: list, aux: Any) -> tuple[list, list]:
        """Folds one micro-batch's aux into the carry; returns (carry, stacked)."""
        carried = iter(carry)
        new_carry, stacked = [], []
        for leaf, reduction, dtype in zip(
            jax.tree.leaves(aux), self.reductions, self.accum_dtypes, strict=True
        ):
            leaf = jnp.asarray(leaf)
            if reduction == "stack":
                stacked.append(leaf)
            elif reduction == "last":
                next(carried)
                new_carry.append(leaf)
            else:
                new_carry.append(next(carried) + leaf.astype(dtype))
        return new_carry, stacked

    def finalize(self, carry: list, stacked: list, num_microbatches: int) -> Any:
        carried, stacks = iter(carry), iter(stacked)
        out = []
        for leaf, reduction in zip(self.leaves, self.reductions, strict=True):
            if reduction == "stack":
                out.append(next(stacks))
                continue
            value = next(carried)
            if reduction == "mean":
                value = value / num_microbatches
                if jnp.issubdtype(leaf.dtype, jnp.inexact):
                    value = value.astype(leaf.dtype)
            elif reduction == "sum":
                value = value.astype(leaf.dtype)
            out.append(value)
        return jax.tree.unflatten(self.treedef, out)


def _weighted_pair(loss: Any) -> tuple[Any, Any]:
    if not (isinstance(loss, tuple | list) and len(loss) == 2):
        raise TypeError(
            "With reduction='weighted', fun must return (loss_sum, weight) (with "
            "has_aux: ((loss_sum, weight), aux)), where loss_sum sums the "
            "micro-batch's losses and weight counts (or sums the weights of) "
            f"what was summed; got {type(loss).__name__}."
        )
    return loss[0], loss[1]


def _check_state(state_vals: tuple, new_state: tuple, state_nums: tuple) -> None:
    """The state fun returns must have the structure, shapes and dtypes it got."""
    for num, before, after in zip(state_nums, state_vals, new_state, strict=True):
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


class _Window:
    """Sums of one window's micro-batch results, and their normalisation."""

    def __init__(
        self,
        out_shape: Any,
        *,
        reduction: str,
        aux_plan: _AuxPlan,
        accum_dtype: Any,
        num_microbatches: int,
        data_axes: tuple[str, ...],
    ):
        (self.value_shape, (self.weight_shape, _, _)), self.grads_shape = out_shape
        self.reduction = reduction
        self.aux_plan = aux_plan
        self.accum_dtype = accum_dtype
        self.num_microbatches = num_microbatches
        self.data_axes = data_axes
        if reduction == "weighted" and jnp.shape(self.weight_shape) != ():
            raise TypeError(
                "With reduction='weighted', the weight fun returns must be a "
                f"scalar, got shape {jnp.shape(self.weight_shape)}."
            )
        per_device = {"stack", "last"} & set(aux_plan.reductions)
        if data_axes and per_device:
            raise ValueError(
                f"aux_reduction {sorted(per_device)} is not supported when each "
                "device accumulates its own rows (shard_value_and_grad): a "
                "per-micro-batch aux value would be one device's, not the "
                "batch's. Use 'mean' (averaged over micro-batches and devices, "
                "exact for per-example means) or 'sum' for those aux leaves."
            )

    def _zeros(self, shape: Any) -> jax.Array:
        dtype = _accum_dtype_for(shape.dtype, self.accum_dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):  # integer weights: float sum
            dtype = self.accum_dtype or jnp.float32
        return _zeros(shape, dtype)

    def zeros(self) -> tuple:
        zeros = (
            self._zeros(self.value_shape),
            jax.tree.map(self._zeros, self.weight_shape),
            jax.tree.map(self._zeros, self.grads_shape),
            self.aux_plan.init(),
        )
        if self.data_axes:
            # Per-device sums differ between devices: the carry is varying.
            return lax.pcast(zeros, self.data_axes, to="varying")
        return zeros

    def add(self, sums: tuple, out: Any) -> tuple[tuple, list]:
        """Adds one micro-batch's results; returns (sums, aux to stack)."""
        (value, (weight, aux, _)), grads = out
        value_sum, weight_sum, grads_sum, aux_carry = sums

        def add(total, x):
            return total + jnp.asarray(x).astype(total.dtype)

        aux_carry, stacked = self.aux_plan.update(aux_carry, aux)
        return (
            add(value_sum, value),
            jax.tree.map(add, weight_sum, weight),
            jax.tree.map(add, grads_sum, grads),
            aux_carry,
        ), stacked

    def result(self, sums: tuple, stacked: list) -> tuple[Any, Any, Any]:
        """Normalises the sums; returns (value, aux, grads) in their own dtypes."""
        num_means = self.num_microbatches
        if self.data_axes:
            # Deferred reduction: each device has summed its own rows over the
            # whole window, and this is the window's only all-reduce.
            sums = lax.psum(sums, self.data_axes)
            num_means *= lax.axis_size(self.data_axes)
        value_sum, weight_sum, grads_sum, aux_carry = sums
        if self.reduction == "weighted":
            value, grads = divide_by_total_weight((value_sum, grads_sum), weight_sum)
        elif self.reduction == "mean":
            value, grads = jax.tree.map(
                lambda total: total / num_means, (value_sum, grads_sum)
            )
        else:
            value, grads = value_sum, grads_sum
        value, grads = jax.tree.map(
            lambda x, shape: x.astype(shape.dtype),
            (value, grads),
            (self.value_shape, self.grads_shape),
        )
        aux = self.aux_plan.finalize(aux_carry, stacked, num_means)
        return value, aux, grads


def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int | None = None,
    *,
    microbatch_size: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    key_argnums: int | Sequence[int] = (),
    state_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    reduction: Reduction = "mean",
    aux_reduction: Any = "mean",
    accum_dtype: Any = jnp.float32,
    pad: bool = False,
    unroll: int | bool = 1,
    remat: bool | Callable[..., Any] = False,
    report_finite: bool = False,
) -> Callable[..., Any]:
    """Creates a function that evaluates ``fun`` and its gradient by micro-batches.

    The batch is split into ``N`` strided micro-batches (example ``i`` goes to
    micro-batch ``i mod N``) and forward + backward runs on one micro-batch at a
    time inside a single ``jax.lax.scan``. Under ``jax.jit`` this is one
    compiled step whose activation memory is that of one micro-batch, and whose
    result equals ``jax.value_and_grad(fun)`` on the whole batch:

    * ``reduction="mean"``: ``fun`` returns the mean loss of the batch it is
      given; the result is the mean over the ``N`` equal micro-batches, which is
      the full-batch mean and its gradient.
    * ``reduction="sum"``: ``fun`` returns a sum; the results are summed.
    * ``reduction="weighted"``: ``fun`` returns ``(loss_sum, weight)``: the sum
      of its micro-batch's per-token (or per-example) losses and the count (or
      total weight) of what was summed. The value is ``sum(loss_sum) /
      sum(weight)`` over the window and the gradient ``sum(grad loss_sum) /
      sum(weight)``: exactly the full-batch masked mean, however unevenly the
      valid tokens fall into micro-batches. A window whose total weight is 0
      gives zero gradients and value 0, never NaN.

    Gradients (and the value) accumulate in ``accum_dtype`` (float32 by default,
    so bfloat16/float16 gradients are cast up) and are returned in their own
    dtype. The scan body is traced and compiled once, whatever ``N``.

    Args:
      fun: the loss function, ``fun(*args, **kwargs) -> loss`` (or
        ``(loss, aux)`` with ``has_aux=True``), where ``loss`` is a scalar, or
        ``(loss_sum, weight)`` with ``reduction="weighted"``.
      num_microbatches: ``N``, the number of micro-batches; must divide the
        batch size (unless ``pad``). Exactly one of ``num_microbatches`` and
        ``microbatch_size``.
      microbatch_size: examples per micro-batch; must divide the batch size
        (unless ``pad``).
      argnums: positional argument(s) to differentiate, as in
        ``jax.value_and_grad``. Their leaves must be floats.
      batch_argnums: positional argument(s) holding the batch: pytrees whose
        leaves share a leading batch axis.
      key_argnums: positional argument(s) holding PRNG keys (typed or raw). Each
        key is split into ``N`` independent keys with ``jax.random.split``, and
        micro-batch ``k`` gets key ``k`` (with ``N == 1`` the key is passed
        unchanged). The same key gives bitwise the same result.
      state_argnums: positional argument(s) holding state that ``fun`` updates,
        such as BatchNorm statistics. ``fun`` then returns ``(out, new_state)``
        (``out`` being what it returns otherwise) and the state is carried
        through the micro-batches in order: micro-batch ``k`` sees the state
        micro-batch ``k - 1`` returned. Not differentiated.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``: what ``fun``'s loss is
        over the batch it is given (see above).
      aux_reduction: how each aux leaf combines over micro-batches: ``"mean"``
        (integer leaves give a float mean), ``"sum"``, ``"stack"`` (all ``N``
        results on a new leading axis, in micro-batch order) or ``"last"``; a
        single string or a pytree prefix of the aux output.
      accum_dtype: dtype float gradients accumulate in (at least); ``None``
        keeps each gradient's own dtype.
      pad: accept a batch size that ``N`` (or ``microbatch_size``) does not
        divide by padding the batch with zero rows at its end. Padded rows must
        contribute nothing, so ``fun`` is then called with a keyword argument
        ``example_mask``: a boolean ``(micro-batch size,)`` array, False on
        padded rows, which ``fun`` must apply to its losses and weights.
        Needs ``reduction="weighted"`` or ``"sum"`` (a mean over micro-batches
        of unequal real size is not the batch mean).
      unroll: passed to ``jax.lax.scan``.
      remat: ``True`` wraps the micro-batch loss in ``jax.checkpoint`` (its
        forward pass is recomputed in the backward pass); a checkpoint policy
        such as ``jax.checkpoint_policies.dots_saveable`` is used as the policy.
      report_finite: also return a :class:`FiniteReport` saying which
        micro-batches had a non-finite loss or gradient.

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``, or
      ``((value, aux), grads)`` with ``has_aux``; with ``state_argnums``, that
      result and the new state: ``(result, new_state)``; with
      ``report_finite``, all that and the report: ``(out, report)``. ``grads``
      has the structure of ``args[argnums]`` (a tuple of them if ``argnums``
      is a sequence).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxaccum
      >>> def loss(params, batch):
      ...     return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)
      >>> params = jnp.ones(3)
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> step = jax.jit(jaxaccum.value_and_grad(loss, num_microbatches=4))
      >>> value, grads = step(params, batch)
      >>> value, grads
      (Array(9., dtype=float32), Array([6., 6., 6.], dtype=float32))
      >>> optimizer = optax.sgd(0.125)
      >>> updates, _ = optimizer.update(grads, optimizer.init(params))
      >>> optax.apply_updates(params, updates)
      Array([0.25, 0.25, 0.25], dtype=float32)
    """
    return _value_and_grad(
        fun,
        num_microbatches,
        microbatch_size=microbatch_size,
        argnums=argnums,
        batch_argnums=batch_argnums,
        key_argnums=key_argnums,
        state_argnums=state_argnums,
        has_aux=has_aux,
        reduction=reduction,
        aux_reduction=aux_reduction,
        accum_dtype=accum_dtype,
        pad=pad,
        unroll=unroll,
        remat=remat,
        report_finite=report_finite,
        data_axes=(),
    )


def _value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int | None,
    *,
    microbatch_size: int | None,
    argnums: int | Sequence[int],
    batch_argnums: int | Sequence[int],
    key_argnums: int | Sequence[int],
    state_argnums: int | Sequence[int],
    has_aux: bool,
    reduction: str,
    aux_reduction: Any,
    accum_dtype: Any,
    pad: bool,
    unroll: int | bool,
    remat: bool | Callable[..., Any],
    data_axes: tuple[str, ...],
    report_finite: bool = False,
) -> Callable[..., Any]:
    """:func:`value_and_grad`; with ``data_axes``, for use inside ``shard_map``.

    With ``data_axes`` (manual mesh axes the batch is split over), each device
    accumulates the sums of its own rows and they are all-reduced once, after
    the micro-batch loop; parameters and keys are prepared per device.
    """
    if (num_microbatches is None) == (microbatch_size is None):
        raise ValueError(
            "Pass exactly one of num_microbatches (how many micro-batches) and "
            "microbatch_size (examples per micro-batch); got "
            f"num_microbatches={num_microbatches!r}, "
            f"microbatch_size={microbatch_size!r}."
        )
    if num_microbatches is not None:
        split.check_count("num_microbatches", num_microbatches)
    else:
        split.check_count("microbatch_size", microbatch_size)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    if pad and reduction == "mean":
        raise ValueError(
            "pad=True needs reduction='weighted' (or 'sum'): padded rows make "
            "the micro-batches' real sizes unequal, so the mean of their means "
            "is not the batch mean. Return (loss_sum, weight) from fun, with "
            "example_mask applied to both, and use reduction='weighted'."
        )
    roles = {
        "argnums": _as_tuple("argnums", argnums),
        "batch_argnums": _as_tuple("batch_argnums", batch_argnums),
        "key_argnums": _as_tuple("key_argnums", key_argnums),
        "state_argnums": _as_tuple("state_argnums", state_argnums),
    }
    diff_nums, batch_nums, key_nums, state_nums = roles.values()
    if not diff_nums:
        raise ValueError("argnums must name at least one argument to differentiate.")
    if not batch_nums:
        raise ValueError("batch_argnums must name at least one batch argument.")
    all_nums = sum(roles.values(), ())
    for index, num in enumerate(all_nums):
        if num in all_nums[:index]:
            named = [name for name, nums in roles.items() if num in nums]
            raise ValueError(
                f"Argument {num} is in {' and '.join(named)}; an argument is "
                "differentiated, split into micro-batches, a PRNG key to split, "
                "or carried state: only one of these."
            )
    policy = None if isinstance(remat, bool) else remat

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= max(all_nums):
            used = ", ".join(f"{name}={nums}" for name, nums in roles.items() if nums)
            raise TypeError(
                f"The accumulated function needs at least {max(all_nums) + 1} "
                f"positional arguments ({used}), got {len(args)}."
            )
        labelled_batches = [(f"args[{i}]", args[i]) for i in batch_nums]
        batch_size = split.batch_size_of(labelled_batches)
        num, padded_size = split.resolve_num_microbatches(
            batch_size, num_microbatches, microbatch_size, pad=pad
        )
        if num > 1:
            split.check_sharded_split(labelled_batches, padded_size, num)
        _check_differentiable(args, diff_nums)

        def micro_loss(diff_vals, batch_vals, key_vals, state_vals, example_mask):
            call_args = list(args)
            for nums, vals in (
                (diff_nums, diff_vals),
                (batch_nums, batch_vals),
                (key_nums, key_vals),
                (state_nums, state_vals),
            ):
                for i, val in zip(nums, vals, strict=True):
                    call_args[i] = val
            extra = {"example_mask": example_mask} if pad else {}
            out = fun(*call_args, **kwargs, **extra)
            new_state = ()
            if state_nums:
                out, new_state = out
                if len(state_nums) == 1:
                    new_state = (new_state,)
            loss, aux = out if has_aux else (out, ())
            weight = ()
            if reduction == "weighted":
                loss, weight = _weighted_pair(loss)
            return loss, (weight, aux, tuple(new_state))

        if remat:
            micro_loss = jax.checkpoint(micro_loss, policy=policy)
        micro_value_and_grad = jax.value_and_grad(micro_loss, has_aux=True)

        diff_vals = tuple(args[i] for i in diff_nums)
        batch_vals = split.pad_batch(tuple(args[i] for i in batch_nums), padded_size)
        key_vals = tuple(args[i] for i in key_nums)
        if data_axes:
            diff_vals, key_vals = _per_device_inputs(diff_vals, key_vals, data_axes)
        state_vals = tuple(args[i] for i in state_nums)
        example_mask = jnp.arange(padded_size) < batch_size if pad else None
        settings = {
            "reduction": reduction,
            "accum_dtype": accum_dtype,
            "num_microbatches": num,
            "data_axes": data_axes,
        }

        if num == 1:
            # No scan and the key passed unchanged: exactly jax.value_and_grad.
            out = micro_value_and_grad(
                diff_vals, batch_vals, key_vals, state_vals, example_mask
            )
            aux = jax.tree.map(jnp.asarray, out[0][1][1])
            aux_plan = _AuxPlan(aux_reduction if has_aux else "mean", aux, accum_dtype)
            window = _Window(jax.eval_shape(lambda: out), aux_plan=aux_plan, **settings)
            sums, stacked = window.add(window.zeros(), out)
            value, aux, grads = window.result(sums, [x[None] for x in stacked])
            new_state = out[0][1][2]
            microbatch_finite = _all_finite(out)[None]
            _check_state(state_vals, new_state, state_nums)
        else:
            value, aux, grads, new_state, microbatch_finite = _scan(
                micro_value_and_grad,
                diff_vals,
                split.strided_view(batch_vals, num),
                _split_keys(key_vals, num),
                state_vals,
                None if example_mask is None else split.strided_view(example_mask, num),
                state_nums=state_nums,
                aux_reduction=aux_reduction if has_aux else "mean",
                unroll=unroll,
                **settings,
            )
        grads = grads[0] if isinstance(argnums, int) else grads
        out = ((value, aux), grads) if has_aux else (value, grads)
        if state_nums:
            out = out, new_state[0] if isinstance(state_argnums, int) else new_state
        if report_finite:
            return out, FiniteReport(microbatch_finite, jnp.all(microbatch_finite))
        return out

    return accumulated


def _scan(
    micro_value_and_grad: Callable[..., Any],
    diff_vals: tuple,
    batch_view: tuple,
    keys: tuple,
    state_vals: tuple,
    mask_view: jax.Array | None,
    *,
    state_nums: tuple,
    reduction: str,
    aux_reduction: Any,
    accum_dtype: Any,
    num_microbatches: int,
    data_axes: tuple[str, ...],
    unroll: int | bool,
) -> tuple[Any, Any, Any, Any, jax.Array]:
    """Runs the micro-batches in one scan.

    Returns (value, aux, grads, state, per-micro-batch finite flags).
    """

    def micro(index, micro_keys, state):
        mask = None if mask_view is None else split.take_microbatch(mask_view, index)
        micro_batch = split.take_microbatch(batch_view, index)
        return micro_value_and_grad(diff_vals, micro_batch, micro_keys, state, mask)

    out_shape = jax.eval_shape(
        micro, jnp.zeros((), jnp.int32), jax.tree.map(lambda k: k[0], keys), state_vals
    )
    _check_state(state_vals, out_shape[0][1][2], state_nums)
    window = _Window(
        out_shape,
        reduction=reduction,
        aux_plan=_AuxPlan(aux_reduction, out_shape[0][1][1], accum_dtype),
        accum_dtype=accum_dtype,
        num_microbatches=num_microbatches,
        data_axes=data_axes,
    )

    def body(carry, xs):
        sums, state = carry
        out = micro(*xs, state)
        sums, stacked = window.add(sums, out)
        return (sums, out[0][1][2]), (stacked, _all_finite(out))

    (sums, state), (stacked, microbatch_finite) = lax.scan(
        body,
        (window.zeros(), state_vals),
        (jnp.arange(num_microbatches), keys),
        unroll=unroll,
    )
    value, aux, grads = window.result(sums, stacked)
    return value, aux, grads, state, microbatch_finite


def grad(
    fun: Callable[..., Any], num_microbatches: int | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """Like :func:`value_and_grad` but returns only the gradient.

    With ``has_aux=True`` returns ``(grads, aux)``, as ``jax.grad`` does; with
    ``state_argnums``, ``(that, new_state)``; with ``report_finite``, all that
    and the :class:`FiniteReport`. All arguments are those of
    :func:`value_and_grad`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> jaxaccum.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.ones((4, 2)))
      Array([1., 1.], dtype=float32)
    """
    value_and_grad_fun = value_and_grad(fun, num_microbatches, **kwargs)
    has_aux = kwargs.get("has_aux", False)
    has_state = bool(_as_tuple("state_argnums", kwargs.get("state_argnums", ())))

    def only_grads(out):
        result, new_state = out if has_state else (out, None)
        value_or_pair, grads = result
        grads = (grads, value_or_pair[1]) if has_aux else grads
        return (grads, new_state) if has_state else grads

    @functools.wraps(fun)
    def grad_fun(*args: Any, **call_kwargs: Any) -> Any:
        out = value_and_grad_fun(*args, **call_kwargs)
        if kwargs.get("report_finite", False):
            return only_grads(out[0]), out[1]
        return only_grads(out)

    return grad_fun
