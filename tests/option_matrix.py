"""The option matrix of jaxaccum's front ends and its reference, shared by
``test_option_matrix.py`` (one device) and ``option_matrix_sharded.py`` (eight).

A drawn :class:`Case` is one cell of the matrix (front end, reduction,
``report_stats``, ``pad``, aux reduction or no aux, parameter dtype, a frozen
argument, a PRNG-key batch leaf, ``N``, mesh) with data drawn from a seed.
:func:`check_case` runs it and compares the value, gradients, aux and
:class:`jaxaccum.WindowStats` with the full batch: ``jax.value_and_grad`` of
the equivalent full-batch loss, and a float64 NumPy reference built from
per-example terms and the strided (per-device) micro-batch layout.

The model: ``z = x @ w + b + offset`` (``x`` real, ``(B, 4)``; ``w`` and
``b`` float32, bfloat16 upcast to float32 inside the loss, or complex64) and
the per-example loss ``f_i = sum_k tanh(Re z_ik) + tanh(Im z_ik) / 2``: real,
using both parts of a complex ``z``, with bounded derivatives.

Tolerances, derived. Inputs lie on a 1/8 grid in [-1, 1), exact in every
dtype, so the float64 reference is exact up to its own ~1e-16. Float32 rounds
``z`` by at most about ``(F + 1) u A_ik`` (``A_ik = sum_f |x_if w_fk| + |b_k|
+ |o_k|``, ``u = 2**-24``); ``tanh`` and its derivative are Lipschitz with
constants <= 1, so a per-example loss is within a few ``u (1 + A_i)`` and a
per-example gradient element within a few ``u |x_if| (1 + A_ik)``: the
*scale* of that term. A sum of ``n`` terms adds at most ``n u sum|terms|``
(whatever the order, which is what differs between micro-batches, the full
batch and CPUs: XLA picks vector code from the host). So a result is within
``K (n + F + 4) u S`` of the exact one, ``S`` its own reduction (mean, sum,
weighted mean) of the scales and ``n`` the rows summed, ``K = 8`` (about
twice the first-order constant). bfloat16 parameters add their own rounding:
each micro-batch's gradient is rounded to bfloat16 (the cast back to the
parameter dtype in its backward pass), and so is the result, each by at most
``2**-8`` of what it rounds, so ``2 * 2**-8`` times the same reduction of the
absolute per-example gradients covers both (the full-batch reference, from
the same values upcast, has none). Squared norms follow
from ``| |a|^2 - |b|^2 | <= e (2 |b| + e)``, ``e = |a - b|_2`` bounded by the
elementwise bound's 2-norm; the estimators from their formulas by interval
arithmetic.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
import jaxaccum.equinox
import jaxaccum.flax
from jaxaccum._types import AUX_REDUCTIONS, REDUCTIONS
from jaxaccum._window._spec import PER_MICROBATCH_AUX

FEATURES, OUTPUTS = 4, 2
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "complex64": jnp.complex64}
UNIT_ROUNDOFF = 2.0**-24  # float32: everything accumulates in it
# A gradient rounded to its own dtype per micro-batch and at the end (above).
DTYPE_ROUNDING = {"float32": 0.0, "complex64": 0.0, "bfloat16": 2 * 2.0**-8}
TOLERANCE_UNITS = 8  # K: twice the first-order constant (module docstring)
WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0)  # sums of these are exact in float32
NUM_MICROBATCHES = (1, 2, 3, 4)
LOCAL_SIZES = (1, 2, 3, 4, 5, 6, 8)  # rows per device
CORE_PATHS = ("value_and_grad", "grad", "equinox", "flax_linen", "flax_nnx")
SHARD_PATHS = ("shard_replicated", "shard_fsdp")
FROZEN = ("none", "positional", "keyword")
# Mesh name -> (data devices, model devices); "single" is one device.
MESHES = {"single": (1, 1), "data2": (2, 1), "data4": (4, 1), "data4_model2": (4, 2)}


@dataclasses.dataclass(frozen=True)
class Combo:
    """One cell of the option matrix (what a compiled function depends on)."""

    path: str
    reduction: str
    report_stats: bool
    pad: bool
    aux_reduction: str | None  # None: has_aux=False
    dtype: str
    frozen: str  # the non-differentiated offset argument: none, positional, keyword
    key_leaf: bool  # the batch holds a per-example PRNG key (unused by the loss)
    num_microbatches: int
    mesh: str = "single"
    masked: bool = False  # num_microbatches is the window's maximum
    # Passed instead of num_microbatches (examples over all devices), which
    # then holds the N it gives.
    microbatch_size: int | None = None
    batch_node: bool = False  # the batch is a registered Rows node (below)
    # Built with loss_scale=True: each call passes a loss_scale= state, and
    # the report is a LossScaleReport (test_loss_scale.py).
    loss_scale: bool = False

    @property
    def devices(self) -> int:
        return MESHES[self.mesh][0]


@dataclasses.dataclass(frozen=True)
class Case:
    combo: Combo
    local_size: int  # rows per data-parallel device
    seed: int

    @property
    def batch_size(self) -> int:
        return self.combo.devices * self.local_size


def cases(
    paths: Sequence[str],
    meshes: Sequence[str] = ("single",),
    dtypes: Sequence[str] = tuple(DTYPES),
    batch_node: bool | None = None,
) -> st.SearchStrategy[Case]:
    """Cases over ``paths``; sharded paths on one of ``meshes``; the batch a
    registered node as ``batch_node`` says (None: drawn). ``pad`` draws a
    batch that ``N`` does not divide (per device), else one it divides. Half
    the cases pass ``microbatch_size`` (the ``N`` drawn, as a size), and
    padded ones then also one micro-batch larger than the batch (``N = 1``,
    padded)."""

    rarely = st.sampled_from((True,) + (False,) * 7)

    @st.composite
    def draw_case(draw: Any) -> Case:
        path = draw(st.sampled_from(paths))
        mesh = draw(st.sampled_from(meshes)) if path in SHARD_PATHS else "single"
        reduction = draw(st.sampled_from(REDUCTIONS))
        num = draw(st.sampled_from(NUM_MICROBATCHES))
        by_size = draw(st.booleans())
        # The documented errors (pad with mean, per-micro-batch aux under
        # shard_map) are checked, but drawn rarely: they compute nothing.
        can_pad = num > 1 or by_size
        pad = can_pad and draw(st.booleans() if reduction != "mean" else rarely)
        aux = draw(st.sampled_from((None, *AUX_REDUCTIONS)))
        if path in SHARD_PATHS and aux in PER_MICROBATCH_AUX and not draw(rarely):
            aux = draw(st.sampled_from((None, "mean", "sum")))
        devices = MESHES[mesh][0]
        if by_size and num == 1 and pad:  # one micro-batch, longer than the rows
            local = draw(st.sampled_from(LOCAL_SIZES[:-1]))
            local_micro = local + draw(st.integers(1, 2))
        else:
            sizes = [size for size in LOCAL_SIZES if (size % num != 0) == pad]
            local = draw(st.sampled_from(sizes))
            local_micro = -(-local // num)
            if by_size:
                num = -(-local // local_micro)  # 5 rows in sizes of 2: 3 of them
        combo = Combo(
            path=path,
            reduction=reduction,
            report_stats=draw(st.booleans()),
            pad=pad,
            aux_reduction=aux,
            dtype=draw(st.sampled_from(dtypes)),
            frozen=draw(st.sampled_from(FROZEN)),
            key_leaf=draw(st.booleans()),
            num_microbatches=num,
            mesh=mesh,
            microbatch_size=local_micro * devices if by_size else None,
            batch_node=draw(st.booleans()) if batch_node is None else batch_node,
        )
        seed = draw(st.integers(0, 2**32 - 1))
        return Case(combo, local, seed)

    return draw_case()


class Data(NamedTuple):
    """A case's inputs as exact NumPy arrays (complex128 or float64)."""

    w: np.ndarray  # (F, K)
    b: np.ndarray  # (K,)
    x: np.ndarray  # (B, F)
    weight: np.ndarray  # (B,)
    offset: np.ndarray  # (K,), zeros when there is no frozen argument


def make_data(case: Case) -> Data:
    rng = np.random.default_rng(case.seed)
    complex_params = case.combo.dtype == "complex64"

    def grid(shape, complex_values=False):
        values = rng.integers(-8, 8, size=shape) / 8
        if complex_values:
            values = values + 1j * rng.integers(-8, 8, size=shape) / 8
        return values

    weight = rng.choice(WEIGHTS, case.batch_size)
    if rng.integers(6) == 0:  # a zero-weight window, more often than by chance
        weight = np.zeros_like(weight)
    offset = grid(OUTPUTS) if case.combo.frozen != "none" else np.zeros(OUTPUTS)
    return Data(
        w=grid((FEATURES, OUTPUTS), complex_params),
        b=grid(OUTPUTS, complex_params),
        x=grid((case.batch_size, FEATURES)),
        weight=weight,
        offset=offset,
    )


@jax.tree_util.register_pytree_node_class
class Rows:
    """A batch node whose static data is its number of rows, as haliax's
    ``NamedArray`` keeps its axes: registered with
    ``jaxaccum.register_batch_node``, so each micro-batch (or device's share,
    or padded batch) must arrive labelled with its own rows."""

    def __init__(self, fields: dict, size: int):
        self.fields, self.size = fields, size

    def __getitem__(self, name: str) -> jax.Array:
        return self.fields[name]

    @property
    def label_factor(self) -> float:
        """1 when the label is right: the rows held over the rows labelled."""
        return self.fields["x"].shape[0] / self.size

    def tree_flatten(self) -> tuple:
        return (self.fields,), self.size

    @classmethod
    def tree_unflatten(cls, size: int, children: tuple) -> "Rows":
        return cls(children[0], size)


jaxaccum.register_batch_node(Rows, lambda size, rows: rows)


# The loss, as each front end sees it.


def upcast(leaf: jax.Array) -> jax.Array:
    """bfloat16 parameters computed in float32 (complex64 stays complex)."""
    return leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))


def scores(w: jax.Array, b: jax.Array, x: jax.Array) -> jax.Array:
    return x @ upcast(w) + upcast(b)


def per_example_losses(z: jax.Array) -> jax.Array:
    return jnp.sum(jnp.tanh(jnp.real(z)) + 0.5 * jnp.tanh(jnp.imag(z)), axis=-1)


def objective(
    z: jax.Array, batch: dict, combo: Combo, example_mask: jax.Array | None
) -> Any:
    """What ``fun`` returns for a micro-batch's scores ``z``: the loss as
    ``combo.reduction`` says, with aux ``{losses, total, count}`` if drawn. A
    :class:`Rows` batch scales the loss by its ``label_factor``: a mislabelled
    micro-batch gives a wrong value and gradient."""
    losses = per_example_losses(z)
    mask = jnp.ones(losses.shape, bool) if example_mask is None else example_mask
    masked = jnp.where(mask, losses, 0.0)
    factor = batch.label_factor if isinstance(batch, Rows) else 1.0
    if combo.reduction == "mean":
        loss: Any = jnp.mean(losses) * factor
    elif combo.reduction == "sum":
        loss = jnp.sum(masked) * factor
    else:
        weight = jnp.where(mask, batch["weight"], 0.0)
        loss = (jnp.sum(weight * masked) * factor, jnp.sum(weight))
    if combo.aux_reduction is None:
        return loss
    aux = {
        "losses": masked,
        "total": jnp.sum(masked),
        "count": jnp.sum(mask, dtype=jnp.int32),
    }
    return loss, aux


def aux_reduction_tree(name: str | None) -> Any:
    """``"concat"`` needs per-example leaves: the scalars take sum and mean."""
    if name == "concat":
        return {"losses": "concat", "total": "sum", "count": "mean"}
    return name or "mean"


def _offset(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("offset", 0.0)


def core_loss(combo: Combo) -> Callable[..., Any]:
    def loss(params, batch, *args, example_mask=None, **kwargs):
        z = scores(params["w"], params["b"], batch["x"]) + _offset(args, kwargs)
        return objective(z, batch, combo, example_mask)

    return loss


class EqxAffine(eqx.Module):
    w: jax.Array
    b: jax.Array
    features: int = FEATURES  # a leaf that is not an array: not differentiated


class LinenAffine(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("w", nn.initializers.zeros, (FEATURES, OUTPUTS), self.dtype)
        b = self.param("b", nn.initializers.zeros, (OUTPUTS,), self.dtype)
        return scores(w, b, x)


class NnxAffine(nnx.Module):
    def __init__(self, w: jax.Array, b: jax.Array):
        self.w = nnx.Param(w)
        self.b = nnx.Param(b)

    def __call__(self, x: jax.Array) -> jax.Array:
        return scores(self.w[...], self.b[...], x)


def front_end_loss(combo: Combo) -> Callable[..., Any]:
    """``fun`` in the shape ``combo.path``'s front end calls it."""
    if combo.path == "equinox":

        def loss(model, batch, *args, example_mask=None, **kwargs):
            z = scores(model.w, model.b, batch["x"]) + _offset(args, kwargs)
            return objective(z, batch, combo, example_mask)

    elif combo.path == "flax_linen":
        module = LinenAffine(DTYPES[combo.dtype])

        def loss(variables, batch, *args, example_mask=None, **kwargs):
            z = module.apply(variables, batch["x"]) + _offset(args, kwargs)
            return objective(z, batch, combo, example_mask)

    elif combo.path == "flax_nnx":

        def loss(model, batch, *args, example_mask=None, **kwargs):
            z = model(batch["x"]) + _offset(args, kwargs)
            return objective(z, batch, combo, example_mask)

    else:
        return core_loss(combo)
    return loss


# Building and running a cell (compiled once per cell, per batch shape).


def mesh_of(name: str) -> Any:
    data, model = MESHES[name]
    if model == 1:
        return jax.make_mesh((data,), ("data",), devices=jax.devices()[:data])
    devices = jax.devices()[: data * model]
    return jax.make_mesh((data, model), ("data", "model"), devices=devices)


def _accumulated(combo: Combo) -> Callable[..., Any]:
    """The front end's accumulated function (bad options raise here)."""
    options = {
        "has_aux": combo.aux_reduction is not None,
        "reduction": combo.reduction,
        "aux_reduction": aux_reduction_tree(combo.aux_reduction),
        "pad": combo.pad,
        "report_stats": combo.report_stats,
    }
    if combo.masked:
        options["masked"] = True
    if combo.loss_scale:
        options["loss_scale"] = True
    fun, num = front_end_loss(combo), combo.num_microbatches
    if combo.microbatch_size is not None:
        num = None  # N from the batch's rows
        options["microbatch_size"] = combo.microbatch_size
    if combo.path in SHARD_PATHS:
        mesh = mesh_of(combo.mesh)
        return jaxaccum.shard_value_and_grad(fun, num, mesh=mesh, **options)
    front_end = {
        "value_and_grad": jaxaccum.value_and_grad,
        "grad": jaxaccum.grad,
        "equinox": jaxaccum.equinox.filter_value_and_grad,
        "flax_linen": jaxaccum.flax.linen_value_and_grad,
        "flax_nnx": jaxaccum.flax.nnx_value_and_grad,
    }[combo.path]
    return front_end(fun, num, **options)


def _model(path: str, params: dict) -> Any:
    """The differentiated argument as ``path``'s front end takes it."""
    if path == "equinox":
        return EqxAffine(params["w"], params["b"])
    if path == "flax_linen":
        return {"params": params}
    if path == "flax_nnx":
        return NnxAffine(params["w"], params["b"])
    return params


def make_step(combo: Combo) -> Callable[..., Any]:
    """``step(params, batch, offset, **call_kwargs)`` for one cell; the
    keywords (``active_microbatches``, ``loss_scale``) go to the accumulated
    function."""
    accumulated = _accumulated(combo)

    def step(params, batch, offset, **call_kwargs):
        model = _model(combo.path, params)
        if combo.frozen == "positional":
            return accumulated(model, batch, offset, **call_kwargs)
        if combo.frozen == "keyword":
            return accumulated(model, batch, offset=offset, **call_kwargs)
        return accumulated(model, batch, **call_kwargs)

    return step


@functools.cache
def build(combo: Combo) -> Callable[..., Any]:
    """:func:`make_step`, jitted (compiled once per cell and batch shape)."""
    return jax.jit(make_step(combo))


def _param_specs(combo: Combo) -> dict:
    if combo.path != "shard_fsdp":
        return {"w": P(), "b": P()}
    if MESHES[combo.mesh][1] == 1:
        return {"w": P("data", None), "b": P()}
    return {"w": P("data", "model"), "b": P("model")}


def inputs(case: Case, data: Data) -> tuple[dict, Any, jax.Array]:
    """``(params, batch, offset)``; on the mesh, for the sharded paths; the
    batch a :class:`Rows` node if the case says so."""
    combo = case.combo
    params = {
        name: jnp.asarray(getattr(data, name), DTYPES[combo.dtype]) for name in "wb"
    }
    batch = {
        "x": jnp.asarray(data.x, jnp.float32),
        "weight": jnp.asarray(data.weight, jnp.float32),
    }
    if combo.key_leaf:
        batch["key"] = jax.random.split(jax.random.key(case.seed), case.batch_size)
    offset = jnp.asarray(data.offset, jnp.float32)
    if combo.path in SHARD_PATHS:
        mesh = mesh_of(combo.mesh)
        specs = _param_specs(combo)
        params = {
            name: jax.device_put(leaf, NamedSharding(mesh, specs[name]))
            for name, leaf in params.items()
        }
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        offset = jax.device_put(offset, NamedSharding(mesh, P()))
    if combo.batch_node:
        return params, Rows(batch, case.batch_size), offset
    return params, batch, offset


class Outcome(NamedTuple):
    value: Any  # None for the grad path
    grads: dict  # {"w", "b"}
    aux: Any  # None without has_aux
    stats: Any  # None without report_stats


def unpack(combo: Combo, raw: Any) -> Outcome:
    """Any front end's result as one :class:`Outcome`."""
    has_aux = combo.aux_reduction is not None
    out, stats = raw if combo.report_stats else (raw, None)
    if combo.path == "grad":
        grads, aux = out if has_aux else (out, None)
        value = None
    else:
        head, grads = out
        value, aux = head if has_aux else (head, None)
    if combo.path == "equinox":
        grads = {"w": grads.w, "b": grads.b}
    elif combo.path == "flax_nnx":
        grads = nnx.to_pure_dict(grads)
    return Outcome(value, dict(grads), aux, stats)


# The reference: float64 per-example terms, the micro-batch layout, jax.


class PerExample(NamedTuple):
    """Exact per-example losses and gradients (``(B, P)``, ``w`` then ``b``
    raveled), and the scale of their float32 rounding (module docstring)."""

    losses: np.ndarray
    loss_scale: np.ndarray
    grads: np.ndarray
    grad_scale: np.ndarray


def per_example(data: Data, complex_params: bool) -> PerExample:
    z = data.x @ data.w + data.b + data.offset  # (B, K)
    losses = np.sum(np.tanh(z.real) + 0.5 * np.tanh(z.imag), axis=-1)
    dz = 1 - np.tanh(z.real) ** 2
    if complex_params:  # jax.grad of a real loss: d/dRe - i d/dIm
        dz = dz - 0.5j * (1 - np.tanh(z.imag) ** 2)
    spread = 1 + np.abs(data.x) @ np.abs(data.w) + np.abs(data.b) + np.abs(data.offset)
    batch_size = len(data.x)
    grad_w = data.x[:, :, None] * dz[:, None, :]
    scale_w = np.abs(data.x)[:, :, None] * spread[:, None, :]
    return PerExample(
        losses=losses,
        loss_scale=spread.sum(axis=-1),
        grads=np.concatenate([grad_w.reshape(batch_size, -1), dz], axis=1),
        grad_scale=np.concatenate([scale_w.reshape(batch_size, -1), spread], axis=1),
    )


def unravel(flat: np.ndarray) -> dict:
    size = FEATURES * OUTPUTS
    return {"w": flat[:size].reshape(FEATURES, OUTPUTS), "b": flat[size:]}


class Micro(NamedTuple):
    """One micro-batch of one device: its real rows (global indices) and
    where they sit among its ``B / (N D)`` rows (the rest is padding)."""

    rows: np.ndarray
    positions: np.ndarray
    size: int


def layout(case: Case) -> list[list[Micro]]:
    """``[device][k]``: device ``d`` holds rows ``[d L, (d + 1) L)``, pads them
    to a multiple of ``N`` if ``pad``, and its micro-batch ``k`` holds its
    local rows ``k, k + N, ...`` (strided)."""
    combo = case.combo
    local, num = case.local_size, combo.num_microbatches
    if combo.microbatch_size is not None:
        padded = num * (combo.microbatch_size // combo.devices)
    else:
        padded = num * -(-local // num)
    padded = padded if combo.pad else local
    devices = []
    for device in range(case.combo.devices):
        micros = []
        for k in range(num):
            local_rows = np.arange(k, padded, num)
            real = local_rows < local
            micros.append(
                Micro(
                    local_rows[real] + device * local,
                    np.flatnonzero(real),
                    padded // num,
                )
            )
        devices.append(micros)
    return devices


def weight_of(rows: np.ndarray, reduction: str, weight: np.ndarray) -> float:
    return float(weight[rows].sum()) if reduction == "weighted" else float(len(rows))


def mean_of(values: np.ndarray, rows: np.ndarray, reduction: str, weight: np.ndarray):
    """The rows' mean (weighted, for ``"weighted"``); 0 where they weigh 0."""
    if reduction == "weighted":
        total = weight[rows].sum()
        return (
            np.tensordot(weight[rows], values[rows], 1) / total
            if total
            else 0 * values[0]
        )
    return values[rows].mean(axis=0) if len(rows) else 0 * values[0]


def total_of(values: np.ndarray, rows: np.ndarray, reduction: str, weight: np.ndarray):
    """What the full-batch loss is over ``rows``: mean, sum or weighted mean."""
    if reduction == "sum":
        return values[rows].sum(axis=0)
    return mean_of(values, rows, reduction, weight)


def units(terms: int) -> float:
    """Float32 tolerance per unit of scale, for a sum of ``terms`` rows."""
    return TOLERANCE_UNITS * (terms + FEATURES + 4) * UNIT_ROUNDOFF


def grad_bound(
    per: PerExample,
    rows: np.ndarray,
    reduction: str,
    dtype: str,
    weight: np.ndarray,
    terms: int,
) -> np.ndarray:
    """The bound on a flat gradient over ``rows``, reduced by ``reduction``
    (pass ``"mean"`` for the per-example-mean gradient of a ``"sum"``): the
    float32 sums' rounding, and ``dtype``'s own roundings relative to what
    they round (at most the absolute per-example gradients, reduced alike)."""

    def reduce(values):
        return total_of(values, rows, reduction, weight)

    own_rounding = DTYPE_ROUNDING[dtype] * reduce(np.abs(per.grads))
    return units(terms) * reduce(per.grad_scale) + own_rounding


@functools.cache
def full_batch_step(reduction: str) -> Callable[..., Any]:
    """``jax.value_and_grad`` of the full-batch loss equivalent to the window's."""

    def loss(params, batch, offset):
        losses = per_example_losses(
            scores(params["w"], params["b"], batch["x"]) + offset
        )
        if reduction == "mean":
            return jnp.mean(losses)
        if reduction == "sum":
            return jnp.sum(losses)
        total = jnp.sum(batch["weight"])
        mean = jnp.sum(batch["weight"] * losses) / jnp.where(total > 0, total, 1.0)
        return jnp.where(total > 0, mean, 0.0)

    return jax.jit(jax.value_and_grad(loss))


def full_batch(case: Case, data: Data) -> tuple[Any, dict]:
    """The full batch's value and gradients, from the parameters upcast."""
    dtype = jnp.promote_types(DTYPES[case.combo.dtype], jnp.float32)
    params = {name: jnp.asarray(getattr(data, name), dtype) for name in "wb"}
    batch = {
        "x": jnp.asarray(data.x, jnp.float32),
        "weight": jnp.asarray(data.weight, jnp.float32),
    }
    return full_batch_step(case.combo.reduction)(
        params, batch, jnp.asarray(data.offset, jnp.float32)
    )


def assert_within(name: str, got: Any, want: Any, tolerance: Any) -> None:
    """``|got - want| <= tolerance`` elementwise (NaN fails), with the figures."""
    got = np.asarray(got).astype(np.complex128)
    want = np.broadcast_to(np.asarray(want, np.complex128), got.shape)
    error = np.abs(got - want)
    tolerance = np.broadcast_to(np.asarray(tolerance, np.float64), got.shape)
    if not np.all(error <= tolerance):
        worst = np.unravel_index(
            np.argmax(np.where(np.isnan(error), np.inf, error)), error.shape
        )
        raise AssertionError(
            f"{name}: error {error[worst]:.3g} > tolerance {tolerance[worst]:.3g} at "
            f"{worst}; got {np.round(got, 6)}, want {np.round(want, 6)}"
        )


# Comparisons.


def _rows_summed(case: Case) -> int:
    """Terms in the longest float32 sum: every padded row, then the N sums."""
    micros = layout(case)[0]
    return (
        case.combo.devices * micros[0].size * len(micros)
        + len(micros) * case.combo.devices
    )


def check_result(case: Case, outcome: Outcome, data: Data, per: PerExample) -> None:
    """Value and gradients against ``jax.value_and_grad`` over the full batch
    (itself checked against the float64 reference), with the dtypes."""
    combo, rows = case.combo, np.arange(case.batch_size)
    reduction, weight = combo.reduction, data.weight
    terms = _rows_summed(case)
    want_value, want_grads = full_batch(case, data)
    value_scale = total_of(per.loss_scale, rows, reduction, weight)
    exact_value = total_of(per.losses, rows, reduction, weight)
    exact_grads = unravel(total_of(per.grads, rows, reduction, weight))
    # The jax reference is float32 from exact inputs: within its own bound.
    reference = unravel(
        grad_bound(per, rows, reduction, "float32", weight, case.batch_size)
    )
    reference_value = units(case.batch_size) * value_scale
    assert_within("full-batch value", want_value, exact_value, reference_value)
    for name in "wb":
        assert_within(
            f"full-batch grads[{name!r}]",
            want_grads[name],
            exact_grads[name],
            reference[name],
        )
    if outcome.value is not None:
        assert outcome.value.dtype == jnp.float32, outcome.value.dtype
        # Both sides within their bound of the exact value: the sum bounds them.
        tolerance = units(terms) * value_scale + reference_value
        assert_within("value", outcome.value, want_value, tolerance)
    accumulated = unravel(grad_bound(per, rows, reduction, combo.dtype, weight, terms))
    for name in "wb":
        got = outcome.grads[name]
        assert got.dtype == DTYPES[combo.dtype], f"grads[{name!r}]: {got.dtype}"
        # Both within their bound of the exact gradient: the sum bounds them.
        tolerance = accumulated[name] + reference[name]
        assert_within(f"grads[{name!r}]", got, want_grads[name], tolerance)


def _micro_aux(micro: Micro, per: PerExample, scale: bool) -> dict:
    """One micro-batch's aux from the reference (or the scale of its rounding)."""
    losses = np.zeros(micro.size)
    losses[micro.positions] = (per.loss_scale if scale else per.losses)[micro.rows]
    count = len(micro.rows)
    return {"losses": losses, "total": losses.sum(), "count": count}


def expected_aux(case: Case, per: PerExample, scale: bool = False) -> dict:
    """The window's aux from its micro-batches' (over devices too, for mean
    and sum), as each aux reduction documents."""
    micros = [micro for device in layout(case) for micro in device]
    per_micro = [_micro_aux(micro, per, scale) for micro in micros]

    def over_micro(reduce):
        return {key: reduce([aux[key] for aux in per_micro]) for key in per_micro[0]}

    name = case.combo.aux_reduction
    if name == "mean":
        return over_micro(lambda values: np.mean(values, axis=0))
    if name == "sum":
        return over_micro(lambda values: np.sum(values, axis=0))
    if name == "stack":
        return over_micro(np.stack)
    if name == "last":
        return per_micro[-1]
    concatenated = per.loss_scale if scale else per.losses
    return {
        "losses": concatenated,
        "total": sum(aux["total"] for aux in per_micro),
        "count": np.mean([aux["count"] for aux in per_micro]),
    }


def check_aux(case: Case, aux: Any, per: PerExample) -> None:
    want, scale = expected_aux(case, per), expected_aux(case, per, scale=True)
    name = case.combo.aux_reduction
    count_reduction = "mean" if name == "concat" else name
    count_dtype = jnp.float32 if count_reduction == "mean" else jnp.int32
    assert set(aux) == set(want), sorted(aux)
    assert aux["count"].dtype == count_dtype, f"aux['count']: {aux['count'].dtype}"
    for key in ("losses", "total"):
        assert aux[key].dtype == jnp.float32, f"aux[{key!r}]: {aux[key].dtype}"
    terms = _rows_summed(case)
    for key in want:
        got = np.asarray(aux[key])
        assert got.shape == np.shape(want[key]), f"aux[{key!r}]: {got.shape}"
        # Per-example losses (a few u of their scale), summed in float32.
        tolerance = units(terms) * np.asarray(scale[key], np.float64)
        assert_within(f"aux[{key!r}] ({name})", got, want[key], tolerance)


def _sq_norm(mean: np.ndarray, tolerance: np.ndarray) -> tuple[float, float]:
    """``|G|^2`` and its bound, from ``G``'s elementwise bound (docstring)."""
    norm, error = float(np.linalg.norm(mean)), float(np.linalg.norm(tolerance))
    # Float32 sum of mean.size squares, then a division by the weight squared.
    rounding = TOLERANCE_UNITS * (mean.size + 4) * UNIT_ROUNDOFF * (norm + error) ** 2
    return norm**2, error * (2 * norm + error) + rounding


class StatsReference(NamedTuple):
    """Expected :class:`jaxaccum.WindowStats` fields, each (value, tolerance)."""

    microbatch_grad_sq_norm: tuple
    grad_sq_norm: tuple
    small_batch: np.ndarray
    big_batch: float
    small_sq_norm: tuple  # S_b, the weight-weighted mean of the micro norms
    num_weighted: int  # N', micro-batches (of all devices) of non-zero weight


def stats_reference(case: Case, data: Data, per: PerExample) -> StatsReference:
    """The mean gradients' squared norms, per micro-batch (the mean over
    devices) and of the window: for every reduction, those of the
    per-example-mean (weighted-mean) gradients."""
    reduction, weight, dtype = case.combo.reduction, data.weight, case.combo.dtype
    # The per-example-mean gradients: a "sum" is divided by its rows.
    mean_reduction = "weighted" if reduction == "weighted" else "mean"
    micros = layout(case)
    terms = micros[0][0].size + 4
    norms, weights = [], []
    for device in micros:
        for micro in device:
            mean = mean_of(per.grads, micro.rows, reduction, weight)
            bound = grad_bound(per, micro.rows, mean_reduction, dtype, weight, terms)
            norms.append(_sq_norm(mean, bound))
            weights.append(weight_of(micro.rows, reduction, weight))
    shape = (len(micros), len(micros[0]))
    norms_by_device = np.asarray(norms).reshape(*shape, 2)
    weights_by_device = np.asarray(weights).reshape(shape)
    total = weights_by_device.sum()
    # Combining the micro-batch norms (over devices, weighted) adds a float32 sum.
    combine = TOLERANCE_UNITS * (len(norms) + 4) * UNIT_ROUNDOFF
    sq, sq_bound = norms_by_device[..., 0], norms_by_device[..., 1]
    small = (weights_by_device * sq).sum() / total if total else 0.0
    small_bound = (weights_by_device * sq_bound).sum() / total if total else 0.0
    rows = np.arange(case.batch_size)
    window = _sq_norm(
        mean_of(per.grads, rows, reduction, weight),
        grad_bound(per, rows, mean_reduction, dtype, weight, _rows_summed(case)),
    )
    return StatsReference(
        microbatch_grad_sq_norm=(sq.mean(0), sq_bound.mean(0) + combine * sq.mean(0)),
        grad_sq_norm=window,
        small_batch=weights_by_device.sum(axis=0),
        big_batch=float(total),
        small_sq_norm=(small, small_bound + combine * small),
        num_weighted=int(np.count_nonzero(weights_by_device)),
    )


def expected_estimates(ref: StatsReference) -> dict:
    """``|G|^2`` and ``tr(Sigma)`` from the reference norms by the docstring's
    formulas, each (value, tolerance) propagated from the norms' bounds; NaN
    where there is one batch size only."""
    if ref.num_weighted <= 1:
        return {
            "gradient_norm_sq": (np.nan, 0.0),
            "gradient_noise_trace": (np.nan, 0.0),
        }
    (small_sq, small_err), (big_sq, big_err) = ref.small_sq_norm, ref.grad_sq_norm
    big = ref.big_batch
    small = big / ref.num_weighted
    # The formula's own float32 operations (and b = W / N'), a few roundings.
    rounding = TOLERANCE_UNITS * 8 * UNIT_ROUNDOFF
    norm_sq = (big * big_sq - small * small_sq) / (big - small)
    norm_err = (
        big * (big_err + rounding * big_sq) + small * (small_err + rounding * small_sq)
    ) / (big - small)
    inverse_gap = 1 / small - 1 / big
    trace = (small_sq - big_sq) / inverse_gap
    trace_err = (small_err + big_err + rounding * (small_sq + big_sq)) / inverse_gap
    return {
        "gradient_norm_sq": (norm_sq, norm_err),
        "gradient_noise_trace": (trace, trace_err),
    }


def _noise_scale_range(estimates: dict) -> tuple[float, float] | None:
    """The range of trace / norm_sq over their bounds; None if it is unbounded."""
    (norm, norm_err), (trace, trace_err) = (
        estimates["gradient_norm_sq"],
        estimates["gradient_noise_trace"],
    )
    if np.isnan(norm) or abs(norm) <= norm_err:
        return None
    corners = [
        t / n
        for t in (trace - trace_err, trace + trace_err)
        for n in (norm - norm_err, norm + norm_err)
    ]
    # The float32 division itself.
    slack = TOLERANCE_UNITS * UNIT_ROUNDOFF * max(abs(c) for c in corners)
    return min(corners) - slack, max(corners) + slack


def check_stats(case: Case, stats: Any, data: Data, per: PerExample) -> None:
    ref = stats_reference(case, data, per)
    num = case.combo.num_microbatches
    for name in ("microbatch_grad_sq_norm", "small_batch", "microbatch_finite"):
        assert np.shape(getattr(stats, name)) == (num,), (
            f"{name}: {np.shape(getattr(stats, name))}"
        )
    assert np.all(stats.microbatch_finite) and bool(stats.finite), (
        stats.microbatch_finite
    )
    np.testing.assert_array_equal(
        stats.small_batch, ref.small_batch, err_msg="small_batch"
    )
    assert float(stats.big_batch) == ref.big_batch, (
        f"big_batch {stats.big_batch} != {ref.big_batch}"
    )
    for name in ("microbatch_grad_sq_norm", "grad_sq_norm"):
        value, tolerance = getattr(ref, name)
        assert_within(name, getattr(stats, name), value, tolerance)
    estimates = expected_estimates(ref)
    for name, (value, tolerance) in estimates.items():
        got = float(getattr(stats, name))
        if np.isnan(value):
            assert np.isnan(got), f"{name}: {got}, want NaN (one batch size)"
        else:
            assert_within(name, got, value, tolerance)
    bounds = _noise_scale_range(estimates)
    got = float(stats.noise_scale)
    if np.isnan(estimates["gradient_norm_sq"][0]):
        assert np.isnan(got), f"noise_scale: {got}, want NaN (one batch size)"
    elif bounds is not None:
        assert bounds[0] <= got <= bounds[1], f"noise_scale {got} not in {bounds}"


def check_outcome(case: Case, outcome: Outcome, data: Data) -> None:
    """The value and gradients, then the aux and the statistics where ``case``
    asks for them, against the big batch of ``data``."""
    per = per_example(data, case.combo.dtype == "complex64")
    check_result(case, outcome, data, per)
    if case.combo.aux_reduction is not None:
        check_aux(case, outcome.aux, per)
    if case.combo.report_stats:
        check_stats(case, outcome.stats, data, per)


def check_case(case: Case) -> str:
    """Runs one cell; returns what happened (an event), raising if wrong."""
    combo = case.combo
    if combo.pad and combo.reduction == "mean":
        with pytest.raises(ValueError, match="pad=True needs reduction"):
            build(combo)
        return "documented error: pad with mean"
    data = make_data(case)
    args = inputs(case, data)
    if combo.path in SHARD_PATHS and combo.aux_reduction in PER_MICROBATCH_AUX:
        with pytest.raises(ValueError, match="not supported when each device"):
            build(combo)(*args)
        return "documented error: per-micro-batch aux under shard_map"
    check_outcome(case, unpack(combo, build(combo)(*args)), data)
    return f"match: {combo.path}"


# Masked windows: k active micro-batches of N, against the first k.

MASKED_PATHS = ("value_and_grad", "equinox", "flax_linen", "flax_nnx")
MICROBATCH_ROWS = (1, 2, 3)
# How active_microbatches is passed: an int32 array or a Python int under
# jit (both traced), or a Python int without jit (concrete: checked).
CALLS = ("array", "python", "eager")


@dataclasses.dataclass(frozen=True)
class MaskedCase:
    """``combo`` (masked, its ``num_microbatches`` the window's ``N``) called
    on a window of ``N`` micro-batches of ``microbatch_rows`` rows, of which
    the first ``active`` hold data (laid out by ``pad_microbatches``)."""

    combo: Combo
    microbatch_rows: int
    active: int
    call: str
    seed: int

    @property
    def in_range(self) -> bool:
        return 1 <= self.active <= self.combo.num_microbatches

    @property
    def reference(self) -> Case:
        """The unmasked case it must equal: its ``active`` micro-batches (all
        ``N`` out of range, for the window's data)."""
        num = self.active if self.in_range else self.combo.num_microbatches
        combo = dataclasses.replace(
            self.combo, num_microbatches=num, masked=False, microbatch_size=None
        )
        return Case(combo, num * self.microbatch_rows, self.seed)


def masked_cases(paths: tuple = MASKED_PATHS) -> st.SearchStrategy[MaskedCase]:
    """Masked cells of the front ends ``paths``, mostly in range; a quarter of
    the counts out of range (0, -1, N + 1, N + 2) and a quarter of the cells
    built without masked (active_microbatches must be refused), which compute
    nothing or little."""
    quarter = st.sampled_from((True, False, False, False))

    @st.composite
    def draw_case(draw: Any) -> MaskedCase:
        num = draw(st.sampled_from(NUM_MICROBATCHES))
        rows = draw(st.sampled_from(MICROBATCH_ROWS))
        if draw(quarter):
            active = draw(st.sampled_from((0, -1, num + 1, num + 2)))
            call = draw(st.sampled_from(CALLS))
        else:
            active, call = draw(st.integers(1, num)), draw(st.sampled_from(CALLS[:2]))
        combo = Combo(
            path=draw(st.sampled_from(paths)),
            reduction=draw(st.sampled_from(REDUCTIONS)),
            report_stats=draw(st.booleans()),
            pad=False,
            aux_reduction=draw(st.sampled_from((None, *AUX_REDUCTIONS))),
            dtype=draw(st.sampled_from(tuple(DTYPES))),
            frozen=draw(st.sampled_from(FROZEN)),
            key_leaf=draw(st.booleans()),
            num_microbatches=num,
            masked=not draw(quarter),
            microbatch_size=rows if draw(st.booleans()) else None,
            batch_node=draw(st.booleans()),
        )
        return MaskedCase(combo, rows, active, call, draw(st.integers(0, 2**32 - 1)))

    return draw_case()


def _first(values: Any, active: int, fill_name: str) -> Any:
    """The first ``active`` of a stacked ``(N, ...)`` array; the others must
    be what a skipped micro-batch leaves (zeros; True finite flags)."""
    values = np.asarray(values)
    fill = True if values.dtype == bool else 0
    np.testing.assert_array_equal(values[active:], fill, err_msg=fill_name)
    return values[:active]


def _first_rows(values: Any, case: MaskedCase) -> np.ndarray:
    """A concatenated aux leaf (window order: row ``j N + m`` is row ``j`` of
    micro-batch ``m``) restricted to the active micro-batches, in the order
    of their batch (row ``j k + m``)."""
    num, rows = case.combo.num_microbatches, case.microbatch_rows
    by_row = np.asarray(values).reshape(rows, num, *np.shape(values)[1:])
    by_micro = np.swapaxes(by_row, 0, 1)
    return np.swapaxes(_first(by_micro, case.active, "concat aux"), 0, 1).reshape(
        rows * case.active, *np.shape(values)[1:]
    )


def first_active(case: MaskedCase, outcome: Outcome) -> Outcome:
    """The outcome as the first ``active`` micro-batches alone give it."""
    active, aux, stats = case.active, outcome.aux, outcome.stats
    if case.combo.aux_reduction == "stack":
        aux = {
            key: _first(value, active, f"aux[{key!r}]") for key, value in aux.items()
        }
    elif case.combo.aux_reduction == "concat":
        aux = {**aux, "losses": _first_rows(aux["losses"], case)}
    if stats is not None:
        stats = stats._replace(
            **{
                name: _first(getattr(stats, name), active, name)
                for name in (
                    "microbatch_grad_sq_norm",
                    "small_batch",
                    "microbatch_finite",
                )
            }
        )
    return outcome._replace(aux=aux, stats=stats)


def assert_no_plausible_number(outcome: Outcome) -> None:
    """Out of range under jit: NaN floats, False flags, the most negative int."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(outcome._asdict()):
        leaf = np.asarray(leaf)
        if leaf.dtype == bool:
            invalid = ~leaf
        elif np.issubdtype(leaf.dtype, np.integer):
            invalid = leaf == np.iinfo(leaf.dtype).min
        else:
            invalid = np.isnan(leaf)
        assert np.all(invalid), f"{jax.tree_util.keystr(path)}: {leaf}, want invalid"


def check_masked_case(case: MaskedCase) -> str:
    """Runs one masked cell; returns what happened (an event), raising if wrong."""
    combo, reference = case.combo, case.reference
    data = make_data(reference)
    params, batch, offset = inputs(reference, data)
    if case.in_range:
        batch = jaxaccum.pad_microbatches(batch, case.active, combo.num_microbatches)
    active = jnp.int32(case.active) if case.call == "array" else case.active
    step = make_step(combo) if case.call == "eager" else build(combo)
    if not combo.masked:
        with pytest.raises(TypeError, match="built without masked=True"):
            step(params, batch, offset, active_microbatches=active)
        return "documented error: active_microbatches without masked"
    if case.call == "eager" and not case.in_range:
        wanted = f"active_microbatches must be from 1 to {combo.num_microbatches}"
        with pytest.raises(ValueError, match=wanted):
            step(params, batch, offset, active_microbatches=active)
        return "documented error: active_microbatches out of range"
    outcome = unpack(combo, step(params, batch, offset, active_microbatches=active))
    if not case.in_range:
        assert_no_plausible_number(outcome)
        return "out of range under jit: no plausible number"
    check_outcome(reference, first_active(case, outcome), data)
    return f"match: masked {combo.path}"
