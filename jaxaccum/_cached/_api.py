"""``cached_value_and_grad``: a loss that sees the whole batch, exact at
micro-batch memory, in one compiled step (gradient caching)."""

import functools

import jax
from typing_extensions import Unpack

from jaxaccum._cached._encode import encode_window
from jaxaccum._cached._library import cached_spec, check_differentiable_args, window_of
from jaxaccum._cached._loss import loss_and_cotangents
from jaxaccum._cached._pullback import pull_back
from jaxaccum._cached._roles import bind_encode, bind_loss
from jaxaccum._types import CachedKwargs, Fun, PyTree


def cached_value_and_grad(
    encode: Fun,
    loss: Fun,
    num_microbatches: int | None = None,
    **options: Unpack[CachedKwargs],
) -> Fun:
    """Returns ``f(params, batch, *args) -> (value, grads)`` for a loss that
    sees the whole batch, computed one micro-batch at a time.

    Equal to ``jax.value_and_grad(lambda p, b, *a: loss(p, encode(p, b, *a),
    *a), argnums)`` where the examples meet only in ``loss``: a contrastive
    loss with in-batch negatives (CLIP, SigLIP, retrieval with labels and hard
    negatives), a term of batch statistics (an MoE balance term). One program,
    two scans (gradient caching, Gao et al. 2021): pass 1 runs ``encode``
    forward on each micro-batch keeping only its outputs; ``loss`` and its
    gradient run once on the whole batch's outputs (parameters ``loss`` uses
    directly, a temperature or a bias, get their gradient once); pass 2 runs
    each micro-batch's forward again and pulls its rows of the loss's
    cotangent back through it, the gradients summed in ``accum_dtype``. Cost:
    two forwards and one backward of ``encode`` per micro-batch; memory: one
    micro-batch's activations plus the outputs and their cotangent.

    Random state: keys in ``key_argnums`` are split per micro-batch as
    :func:`value_and_grad` splits them (unchanged at ``N = 1``) and pass 2
    draws the same keys as pass 1, so its forward is pass 1's, bit for bit;
    per-example keys carried as a batch leaf make dropout the big batch's at
    any ``N``. Mutable state is refused (there is no ``state_argnums``):
    BatchNorm's statistics over a micro-batch are not the big batch's, so an
    encoder with them cannot be exact; use LayerNorm or GroupNorm, or
    BatchNorm's running averages.

    Args:
      encode: ``encode(*args)`` with the batch argument a micro-batch (and keys
        a micro-batch's): per-example outputs, a pytree of arrays whose leading
        axis is the micro-batch's rows. Labels, hard-negative ids and other
        per-example data reach the loss as outputs.
      loss: ``loss(*args)`` with the batch argument replaced by the whole
        batch's outputs, in the batch's order (other batch arguments by
        ``None``; keys unsplit): a scalar (``(value, aux)`` with ``has_aux``).
      num_microbatches: ``N``; it must divide the batch size. Exactly one of
        it and ``microbatch_size``.
      **options: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch, instead of ``N``.
      argnums: positional argument(s) to differentiate (float leaves).
      batch_argnums: positional argument(s) holding the batch, split on axis 0
        as :func:`value_and_grad` splits it (strided).
      key_argnums: positional argument(s) holding PRNG keys, split per
        micro-batch.
      has_aux: whether ``loss`` returns ``(value, aux)``.
      accum_dtype: dtype the gradients sum in (at least; float32 by
        default). Float outputs narrower than it reach ``loss`` cast up to it
        (values unchanged), so the loss's backward and the cotangent are in
        it until they meet each micro-batch's pullback; ``None`` keeps every
        dtype as it is.
      unroll: passed to both scans' ``jax.lax.scan``.

    Returns:
      A function of the arguments returning ``(value, grads)`` (``((value,
      aux), grads)`` with ``has_aux``), ``grads`` like ``args[argnums]``.

    Raises:
      TypeError: for an unknown option, one that has no meaning here
        (``reduction``, ``state_argnums``, ``pad``, ...: the message says why)
        or non-float ``argnums``.
      ValueError: for a batch ``N`` does not divide, or an output leaf without
        the micro-batch's leading axis (named).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxaccum
      >>> def encode(w, x):
      ...     return x @ w
      >>> def loss(w, z):  # every example against every other
      ...     logits = z @ z.T
      ...     return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), jnp.arange(8)])
      >>> w, x = jnp.eye(3) / 4, jnp.arange(24.0).reshape(8, 3) / 24
      >>> step = jax.jit(jaxaccum.cached_value_and_grad(encode, loss, 4))
      >>> value, grads = step(w, x)
      >>> big = jax.value_and_grad(lambda w, x: loss(w, encode(w, x)))(w, x)
      >>> bool(jnp.allclose(value, big[0]) and jnp.allclose(grads, big[1]))
      True

    References:
      Gao, Zhang, Han and Callan, "Scaling Deep Contrastive Learning Batch
      Size under Memory Limited Setup", 2021.
    """
    spec = cached_spec(num_microbatches, options)

    @functools.wraps(loss)
    def cached(*args: PyTree) -> PyTree:
        window = window_of(args, spec)
        check_differentiable_args(args, spec.diff_nums)
        diff = tuple(args[i] for i in spec.diff_nums)
        encode_at = bind_encode(encode, args, spec)
        outputs = encode_window(encode_at, diff, window, spec.unroll)
        whole = loss_and_cotangents(
            bind_loss(loss, args, spec),
            diff,
            outputs,
            has_aux=spec.has_aux,
            accum_dtype=spec.accum_dtype,
        )
        sums = pull_back(
            encode_at,
            diff,
            window,
            whole.cotangents,
            accum_dtype=spec.accum_dtype,
            unroll=spec.unroll,
        )
        grads = jax.tree.map(
            lambda total, direct, param: (total + direct.astype(total.dtype)).astype(
                jax.numpy.result_type(param)
            ),
            sums,
            whole.diff_grads,
            diff,
        )
        grads = grads[0] if isinstance(spec.argnums, int) else grads
        return ((whole.value, whole.aux) if spec.has_aux else whole.value), grads

    return cached
