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

    Data parallel: under plain ``jit`` on a batch sharded over devices it is
    exact, but XLA all-reduces the replicated gradient sum in every pass-2
    iteration. With ``mesh=`` and ``data_axis=`` (as
    :func:`shard_value_and_grad` takes them) the window runs per device under
    ``shard_map``: each device runs pass 1 over its rows' micro-batches, the
    outputs are all-gathered once (one all-gather per output dtype) so the
    loss and its gradient run on the whole batch, identically on every
    device; each device slices its rows of the cotangent, runs pass 2 over
    them, and one all-reduce after the loop sums the gradients (the loss's
    direct part counted once) with the value and aux (one per dtype: an
    integer aux adds one). Nothing collective runs inside either loop.
    ``N`` micro-batches per device, each spread over all ``D`` devices.
    The parameters must be replicated over the data axes: an FSDP layout
    (parameters sharded over them) is refused for now. Per device, ``loss``
    sees values typed as varying over the data axes (``shard_map``'s rule): a
    ``lax.scan`` in it starts its carry from its inputs (``jnp.zeros_like``),
    not from constants, as :mod:`jaxaccum.losses` does.

    Random state: keys in ``key_argnums`` are split per micro-batch as
    :func:`value_and_grad` splits them (unchanged at ``N = 1``) and pass 2
    draws the same keys as pass 1, so its forward is pass 1's, bit for bit;
    per-example keys carried as a batch leaf make dropout the big batch's at
    any ``N``. With ``mesh=`` the encoder's keys are
    folded with the device's index before the split (as
    :func:`shard_value_and_grad` does), so devices draw independent dropout
    for their rows and passes 1 and 2 still draw the same; they are not the
    unsharded window's keys (random bits depend on the micro-batch's shape,
    which a device holds a share of). ``loss`` gets the call's keys.

    Mutable state is refused (there is no ``state_argnums``): BatchNorm's
    statistics over a micro-batch are not the big batch's, so an encoder
    with them cannot be exact; use LayerNorm or GroupNorm, or BatchNorm's
    running averages.

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
      microbatch_size: examples per micro-batch, instead of ``N`` (with a
        mesh, over all ``D`` devices: a multiple of ``D``).
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
      mesh: run the window per device on this mesh (a
        ``jax.sharding.Mesh``); with only ``data_axis``, the one set with
        ``jax.set_mesh``. Neither: one window, as ``jit`` shards it.
      data_axis: the mesh axis (or axes) the batch is sharded over on axis
        0 (``"data"`` when only ``mesh`` is given).

    Returns:
      A function of the arguments returning ``(value, grads)`` (``((value,
      aux), grads)`` with ``has_aux``), ``grads`` like ``args[argnums]``.

    Raises:
      TypeError: for an unknown option, one that has no meaning here
        (``reduction``, ``state_argnums``, ``pad``, ...: the message says why)
        or non-float ``argnums``.
      ValueError: for a batch ``N`` does not divide, or an output leaf without
        the micro-batch's leading axis (named); with a mesh, for a
        ``data_axis`` not in it, a batch its devices do not split equally, or
        a parameter sharded over the data axes (FSDP; named).

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
    window_options = {
        name: value
        for name, value in options.items()
        if name not in ("mesh", "data_axis")
    }
    mesh = options.get("mesh")
    data_axes = mesh_axes(mesh, options.get("data_axis"))
    spec = cached_spec(num_microbatches, window_options, data_axes)

    def window(args: tuple, window_spec: WindowSpec) -> PyTree:
        return two_passes(encode, loss, args, window_spec)

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
