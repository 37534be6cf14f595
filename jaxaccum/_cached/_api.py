"""``cached_value_and_grad``: a loss that sees the whole batch, exact at
micro-batch memory, in one compiled step (gradient caching)."""

import jax
import jax.numpy as jnp
from typing_extensions import Unpack

from jaxaccum._cached._encode import encode_window
from jaxaccum._cached._library import (
    WindowSpec,
    cached_spec,
    check_differentiable_args,
    window_of,
)
from jaxaccum._cached._loss import loss_and_cotangents
from jaxaccum._cached._pullback import pull_back
from jaxaccum._cached._roles import bind_encode, bind_loss
from jaxaccum._cached._sharded import DeviceRows, mesh_axes, per_device
from jaxaccum._types import CachedKwargs, Fun, PyTree
from jaxaccum._window._conv_layout import window_kernels


def cached_value_and_grad(
    encode: Fun,
    loss: Fun,
    num_microbatches: int | None = None,
    **options: Unpack[CachedKwargs],
) -> Fun:
    """Returns ``f(params, batch, *args) -> (value, grads)`` for a loss that
    sees the whole batch, computed one micro-batch at a time.

    Equal to ``jax.value_and_grad(lambda p, b, *a: loss(p, encode(p, b, *a),
    *a), argnums)`` up to the order of float sums, where examples meet only
    in ``loss`` (in-batch negatives, batch statistics), by gradient caching
    (Gao et al. 2021): two scans over the micro-batches around one loss.
    How, costs, keys, sharding: [Losses that see the whole
    batch](../guides/whole-batch.md).

    Args:
      encode: ``encode(*args)``, the batch argument (and keys) a micro-batch's:
        per-example outputs, arrays led by the micro-batch's rows (labels too).
      loss: ``loss(*args)``, the batch argument the whole batch's outputs in
        its order (other batch arguments ``None``, keys unsplit): a real
        float scalar (``(value, aux)`` with ``has_aux``).
      num_microbatches: ``N``, dividing the batch size; exactly one of it and
        ``microbatch_size``.
      **options: the keyword options below.

    Keyword Args:
      microbatch_size: examples per micro-batch, instead of ``N`` (with a
        mesh, over all ``D`` devices: a multiple of ``D``).
      argnums: positional argument(s) to differentiate (float leaves).
      batch_argnums: positional argument(s) holding the batch, split on axis 0
        (strided, as :func:`value_and_grad` splits it).
      key_argnums: positional argument(s) holding PRNG keys, split per
        micro-batch as :func:`value_and_grad` splits them (both passes alike).
      has_aux: whether ``loss`` returns ``(value, aux)``.
      accum_dtype: a floating dtype (float32 by default) or ``None``: gradients
        sum, and narrower float outputs reach ``loss``, in at least it.
      unroll: passed to both scans' ``jax.lax.scan``.
      conv_layout: as for :func:`value_and_grad` (the encoder's convolutions).
      mesh: run the window per device on this ``jax.sharding.Mesh`` (with only
        ``data_axis``, ``jax.set_mesh``'s), parameters replicated over it.
      data_axis: the mesh axis (or axes) the batch is sharded over on axis
        0 (``"data"`` when only ``mesh`` is given).

    Returns:
      A function of the arguments returning ``(value, grads)`` (``((value,
      aux), grads)`` with ``has_aux``), ``grads`` like ``args[argnums]``.

    Raises:
      TypeError: for an unknown option or one without meaning here (the
        message says why), non-float ``argnums``, a loss not a real scalar.
      ValueError: for a batch ``N`` does not divide, an output without its
        leading axis, mutable state; with a mesh, a foreign axis or FSDP leaf.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> encode = lambda w, x: x @ w
      >>> def loss(w, z):  # every example against every other
      ...     return -jnp.mean(jnp.diag(jax.nn.log_softmax(z @ z.T)))
      >>> w, x = jnp.eye(3) / 4, jnp.arange(24.0).reshape(8, 3) / 24
      >>> step = jax.jit(jaxaccum.cached_value_and_grad(encode, loss, 4))
      >>> value, grads = step(w, x)
      >>> big = jax.value_and_grad(lambda w, x: loss(w, encode(w, x)))(w, x)
      >>> bool(jnp.allclose(value, big[0]) and jnp.allclose(grads, big[1]))
      True
    """
    window_options = {
        name: value
        for name, value in options.items()
        if name not in ("mesh", "data_axis")
    }
    mesh = options.get("mesh")
    data_axes = mesh_axes(mesh, options.get("data_axis"))
    spec = cached_spec(num_microbatches, window_options, data_axes)

    def window(args: tuple, window_spec: WindowSpec) -> PyTree:
        def passes(*args: PyTree) -> PyTree:
            return two_passes(encode, loss, args, window_spec)

        return window_kernels(passes, window_spec.conv_layout)(*args)

    if data_axes:
        return per_device(window, spec, mesh)

    # Not functools.wraps(loss): this function takes the batch where loss
    # takes the encoder's outputs, so loss's signature would mislead.
    def cached(*args: PyTree) -> PyTree:
        return window(args, spec)

    return cached


def two_passes(encode: Fun, loss: Fun, args: tuple, spec: WindowSpec) -> PyTree:
    """The window on the batch in ``args`` (the whole batch, or a device's
    rows with ``spec.data_axes``): pass 1, the loss once, pass 2."""
    rows = DeviceRows(spec.data_axes)
    window = window_of(rows.encoder_args(args, spec), spec)
    check_differentiable_args(args, spec.diff_nums)
    params = tuple(args[i] for i in spec.diff_nums)
    diff = rows.varying(params)
    encode_at = bind_encode(encode, args, spec)
    outputs = rows.gather(encode_window(encode_at, diff, window, spec.unroll))
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
        rows.own_rows(whole.cotangents),
        accum_dtype=spec.accum_dtype,
        unroll=spec.unroll,
        varying=rows.varying,
    )
    (value, aux), grads = rows.reduce(sums, whole)
    grads = jax.tree.map(
        lambda grad, param: grad.astype(jnp.result_type(param)), grads, params
    )
    grads = grads[0] if isinstance(spec.argnums, int) else grads
    return ((value, aux) if spec.has_aux else value), grads
