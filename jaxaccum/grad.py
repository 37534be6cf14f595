"""In-step accumulation: ``value_and_grad`` over micro-batches in one ``lax.scan``."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxaccum import split

Reduction = Literal["mean", "sum"]
AuxReduction = Literal["mean", "sum", "stack", "last"]

_REDUCTIONS = ("mean", "sum")
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
            jnp.zeros(leaf.shape, dtype)
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


def value_and_grad(
    fun: Callable[..., Any],
    num_microbatches: int | None = None,
    *,
    microbatch_size: int | None = None,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] = 1,
    key_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    reduction: Reduction = "mean",
    aux_reduction: Any = "mean",
    accum_dtype: Any = jnp.float32,
    unroll: int | bool = 1,
    remat: bool | Callable[..., Any] = False,
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

    Gradients (and the value) accumulate in ``accum_dtype`` (float32 by default,
    so bfloat16/float16 gradients are cast up) and are returned in their own
    dtype. The scan body is traced and compiled once, whatever ``N``.

    Args:
      fun: the loss function, ``fun(*args, **kwargs) -> scalar`` (or
        ``(scalar, aux)`` with ``has_aux=True``).
      num_microbatches: ``N``, the number of micro-batches; must divide the
        batch size. Exactly one of ``num_microbatches`` and ``microbatch_size``.
      microbatch_size: examples per micro-batch; must divide the batch size.
      argnums: positional argument(s) to differentiate, as in
        ``jax.value_and_grad``. Their leaves must be floats.
      batch_argnums: positional argument(s) holding the batch: pytrees whose
        leaves share a leading batch axis. Must not overlap ``argnums``.
      key_argnums: positional argument(s) holding PRNG keys (typed or raw). Each
        key is split into ``N`` independent keys with ``jax.random.split``, one
        per micro-batch (with ``N == 1`` the key is passed unchanged). The same
        key gives bitwise the same result.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      reduction: ``"mean"`` or ``"sum"``; what ``fun``'s loss is over a batch.
      aux_reduction: how each aux leaf combines over micro-batches: ``"mean"``
        (integer leaves give a float mean), ``"sum"``, ``"stack"`` (all ``N``
        results on a new leading axis, in micro-batch order) or ``"last"``; a
        single string or a pytree prefix of the aux output.
      accum_dtype: dtype float gradients accumulate in (at least); ``None``
        keeps each gradient's own dtype.
      unroll: passed to ``jax.lax.scan``.
      remat: ``True`` wraps the micro-batch loss in ``jax.checkpoint`` (its
        forward pass is recomputed in the backward pass); a checkpoint policy
        such as ``jax.checkpoint_policies.dots_saveable`` is used as the policy.

    Returns:
      A function with ``fun``'s signature returning ``(value, grads)``, or
      ``((value, aux), grads)`` with ``has_aux``. ``grads`` has the structure of
      ``args[argnums]`` (a tuple of them if ``argnums`` is a sequence).

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
    diff_nums = _as_tuple("argnums", argnums)
    batch_nums = _as_tuple("batch_argnums", batch_argnums)
    key_nums = _as_tuple("key_argnums", key_argnums)
    if not diff_nums:
        raise ValueError("argnums must name at least one argument to differentiate.")
    if not batch_nums:
        raise ValueError("batch_argnums must name at least one batch argument.")
    roles = {"argnums": diff_nums, "batch_argnums": batch_nums, "key_argnums": key_nums}
    for index, num in enumerate(diff_nums + batch_nums + key_nums):
        if num in (diff_nums + batch_nums + key_nums)[:index]:
            named = [name for name, nums in roles.items() if num in nums]
            raise ValueError(
                f"Argument {num} is in {' and '.join(named)}; an argument is "
                "either differentiated, split into micro-batches, or a PRNG key "
                "to split, not several of these."
            )
    policy = None if isinstance(remat, bool) else remat

    @functools.wraps(fun)
    def accumulated(*args: Any, **kwargs: Any) -> Any:
        needed = max(diff_nums + batch_nums + key_nums) + 1
        if len(args) < needed:
            raise TypeError(
                f"The accumulated function needs at least {needed} positional "
                f"arguments (argnums={argnums!r}, batch_argnums="
                f"{batch_argnums!r}, key_argnums={key_argnums!r}), got {len(args)}."
            )
        batch_size = split.batch_size_of([(f"args[{i}]", args[i]) for i in batch_nums])
        num = split.resolve_num_microbatches(
            batch_size, num_microbatches, microbatch_size
        )
        _check_differentiable(args, diff_nums)

        def loss(diff_vals, batch_vals, key_vals):
            call_args = list(args)
            for nums, vals in (
                (diff_nums, diff_vals),
                (batch_nums, batch_vals),
                (key_nums, key_vals),
            ):
                for i, val in zip(nums, vals, strict=True):
                    call_args[i] = val
            out = fun(*call_args, **kwargs)
            return out if has_aux else (out, ())

        if remat:
            loss = jax.checkpoint(loss, policy=policy)
        micro_value_and_grad = jax.value_and_grad(loss, has_aux=True)

        diff_vals = tuple(args[i] for i in diff_nums)
        batch_vals = tuple(args[i] for i in batch_nums)
        key_vals = tuple(args[i] for i in key_nums)

        if num == 1:
            # Exactly jax.value_and_grad: no scan, keys passed unchanged.
            (value, aux), grads = micro_value_and_grad(diff_vals, batch_vals, key_vals)
            if has_aux:
                aux = jax.tree.map(jnp.asarray, aux)
                plan = _AuxPlan(aux_reduction, aux, accum_dtype)
                carry, stacked = plan.update(plan.init(), aux)
                stacked = [leaf[None] for leaf in stacked]
                aux = plan.finalize(carry, stacked, 1)
        else:
            value, aux, grads = _scan(
                micro_value_and_grad,
                diff_vals,
                split.strided_view(batch_vals, num),
                _split_keys(key_vals, num),
                num,
                reduction=reduction,
                has_aux=has_aux,
                aux_reduction=aux_reduction,
                accum_dtype=accum_dtype,
                unroll=unroll,
            )
        grads = grads[0] if isinstance(argnums, int) else grads
        return ((value, aux), grads) if has_aux else (value, grads)

    return accumulated


def _scan(
    micro_value_and_grad: Callable[..., Any],
    diff_vals: tuple,
    batch_view: tuple,
    keys: tuple,
    num: int,
    *,
    reduction: str,
    has_aux: bool,
    aux_reduction: Any,
    accum_dtype: Any,
    unroll: int | bool,
) -> tuple[Any, Any, Any]:
    """Runs the micro-batches in one scan; returns (value, aux, grads)."""
    first_batch = split.take_microbatch(batch_view, jnp.zeros((), jnp.int32))
    first_keys = jax.tree.map(lambda k: k[0], keys)
    (value_shape, aux_shape), grads_shape = jax.eval_shape(
        micro_value_and_grad, diff_vals, first_batch, first_keys
    )
    plan = _AuxPlan(aux_reduction if has_aux else "mean", aux_shape, accum_dtype)

    def zeros(shape):
        return jnp.zeros(shape.shape, _accum_dtype_for(shape.dtype, accum_dtype))

    init = (
        jax.tree.map(zeros, value_shape),
        jax.tree.map(zeros, grads_shape),
        plan.init(),
    )

    def body(carry, xs):
        index, micro_keys = xs
        value_sum, grads_sum, aux_carry = carry
        micro_batch = split.take_microbatch(batch_view, index)
        (value, aux), grads = micro_value_and_grad(diff_vals, micro_batch, micro_keys)
        grads_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grads_sum, grads)
        aux_carry, stacked = plan.update(aux_carry, aux)
        return (
            value_sum + value.astype(value_sum.dtype),
            grads_sum,
            aux_carry,
        ), stacked

    (value_sum, grads_sum, aux_carry), stacked = lax.scan(
        body, init, (jnp.arange(num), keys), unroll=unroll
    )
    scale = num if reduction == "mean" else 1

    def finish(total, shape):
        return (total / scale).astype(shape.dtype)

    value = finish(value_sum, value_shape)
    grads = jax.tree.map(finish, grads_sum, grads_shape)
    aux = plan.finalize(aux_carry, stacked, num)
    return value, aux, grads


def grad(fun: Callable[..., Any], num_microbatches: int | None = None, **kwargs: Any):
    """Like :func:`value_and_grad` but returns only the gradient.

    With ``has_aux=True`` returns ``(grads, aux)``, as ``jax.grad`` does. All
    arguments are those of :func:`value_and_grad`.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxaccum
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> jaxaccum.grad(loss, num_microbatches=2)(jnp.ones(2), jnp.ones((4, 2)))
      Array([1., 1.], dtype=float32)
    """
    value_and_grad_fun = value_and_grad(fun, num_microbatches, **kwargs)
    has_aux = kwargs.get("has_aux", False)

    @functools.wraps(fun)
    def grad_fun(*args: Any, **call_kwargs: Any) -> Any:
        out, grads = value_and_grad_fun(*args, **call_kwargs)
        return (grads, out[1]) if has_aux else grads

    return grad_fun
