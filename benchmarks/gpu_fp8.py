"""FP8 on the device at hand: how far a window's weight gradients are from the
big batch's, beside the floor that FP8 arithmetic itself sets.

Flax's ``Fp8DirectDotGeneralOp`` layers (an MLP; on a Hopper GPU XLA turns
them into cuBLASLt FP8 GEMMs, counted in the compiled program) take STEPS
SGD steps of the big batch. At each step's variables every contender's
gradient is taken and compared with the big batch's (relative norm of the
difference, the largest over the kernels; the metadata as the largest
relative difference of any amax history or scale):

- ``jaxaccum``: ``jaxaccum.grad(loss, N)``;
- ``blocks``: the same window written by hand, unrolled: each strided row
  block differentiated at its share of the batch, the gradients summed, the
  metadata maxed (what jaxaccum computes, without the scan);
- ``permuted``: the big batch, its rows permuted (the GEMMs sum in another
  order);
- ``padded``: the big batch with B/N rows of weight zero appended (the same
  sum, computed by GEMMs of another M, where cuBLAS may pick other kernels);
- ``float32``: the same model with plain dots, no FP8 (how far FP8 is from
  the arithmetic it stands for).

If ``padded`` and ``permuted`` are as far from the big batch as ``jaxaccum``
is, the window's difference is FP8 arithmetic, not the window.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import fp8_ops
from jax.flatten_util import ravel_pytree

import jaxaccum

META = fp8_ops.OVERWRITE_WITH_GRADIENT
HISTORY = 16
LEARNING_RATE = 1e-2


class Mlp(nn.Module):
    hidden: int
    out: int
    fp8: bool = True

    @nn.compact
    def __call__(self, x):
        def dense(features):
            if not self.fp8:
                return nn.Dense(features)
            return nn.Dense(
                features,
                dot_general_cls=lambda: fp8_ops.Fp8DirectDotGeneralOp(
                    amax_history_length=HISTORY
                ),
            )

        return dense(self.out)(nn.relu(dense(self.hidden)(x)))


def _per_row(model, variables, batch):
    return jnp.mean((model.apply(variables, batch["x"]) - batch["y"]) ** 2, -1)


def _gap(mine, big) -> float:
    """Largest relative norm of the difference over the leaves."""
    gaps = jax.tree.map(
        lambda a, b: (
            jnp.linalg.norm((a - b).ravel())
            / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30)
        ),
        mine,
        big,
    )
    return float(max(jax.tree.leaves(gaps)))


def _meta_gap(mine, big) -> float:
    gaps = jax.tree.map(
        lambda a, b: jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30),
        mine,
        big,
    )
    return float(max(jax.tree.leaves(gaps)))


def measure(
    batch_size: int, features: int, hidden: int, num: int, steps: int, seed: int = 0
) -> dict:
    """The gaps above, per step, and the FP8 GEMMs in the compiled gradient."""
    model, plain = Mlp(hidden, features), Mlp(hidden, features, fp8=False)
    key_init, key_teacher, key_data = jax.random.split(jax.random.key(seed), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        variables = model.init(key_init, jnp.ones((1, features)))
    teacher = jax.random.normal(key_teacher, (features, features)) / np.sqrt(features)

    def loss(v, b):  # the batch's mean, as a sum at a fixed share
        return jnp.sum(_per_row(model, v, b) * b["w"]) / batch_size

    def loss_f32(params, b):
        return jnp.sum(_per_row(plain, {"params": params}, b) * b["w"]) / batch_size

    def blocks(v, b):
        parts = [
            jax.grad(loss)(v, jax.tree.map(lambda x, k=k: x[k::num], b))
            for k in range(num)
        ]
        out = jax.tree.map(lambda *g: sum(g), *parts)
        out[META] = jax.tree.map(
            lambda *g: jnp.max(jnp.stack(g), 0), *[g[META] for g in parts]
        )
        return out

    perm = jax.random.permutation(jax.random.key(seed + 1), batch_size)
    pad = batch_size // num
    contenders = {
        "big": jax.jit(jax.grad(loss)),
        "jaxaccum": jax.jit(jaxaccum.grad(loss, num, reduction="sum")),
        "blocks": jax.jit(blocks),
        "permuted": jax.jit(
            lambda v, b: jax.grad(loss)(v, jax.tree.map(lambda x: x[perm], b))
        ),
        "padded": jax.jit(
            lambda v, b: jax.grad(loss)(
                v,
                jax.tree.map(
                    lambda x: jnp.concatenate(
                        [x, jnp.zeros((pad, *x.shape[1:]), x.dtype)]
                    ),
                    b,
                ),
            )
        ),
    }
    grad_f32 = jax.jit(jax.grad(loss_f32))
    # The big batch compiled once: its program is the one read for FP8 GEMMs.
    first = _batch(jax.random.fold_in(key_data, 0), teacher, batch_size)
    contenders["big"] = contenders["big"].lower(variables, first).compile()
    hlo = contenders["big"].as_text()
    gaps: dict[str, list[float]] = {name: [] for name in contenders if name != "big"}
    gaps["float32"] = []
    meta: dict[str, list[float]] = {name: [] for name in contenders if name != "big"}
    for step in range(steps):
        batch = _batch(jax.random.fold_in(key_data, step), teacher, batch_size)
        grads = {name: fun(variables, batch) for name, fun in contenders.items()}
        big = grads["big"]
        for name in meta:
            gaps[name].append(_gap(grads[name]["params"], big["params"]))
            meta[name].append(_meta_gap(grads[name][META], big[META]))
        gaps["float32"].append(
            _gap(grad_f32(variables["params"], batch), big["params"])
        )
        variables = {
            "params": jax.tree.map(
                lambda p, g: p - LEARNING_RATE * g, variables["params"], big["params"]
            ),
            META: big[META],
        }
    return {
        "batch": batch_size,
        "features": features,
        "hidden": hidden,
        "num_microbatches": num,
        "steps": steps,
        "fp8_gemms_in_compiled_grad": _count_fp8_gemms(hlo),
        "weight_grad_gap": gaps,
        "metadata_gap": meta,
        "param_norm": float(jnp.linalg.norm(ravel_pytree(variables["params"])[0])),
    }


def _count_fp8_gemms(hlo: str) -> int:
    """cuBLASLt FP8 GEMM calls (GPU), else dots reading an f8 operand."""
    calls = sum(
        'custom_call_target="__cublas$lt$matmul$f8"' in line
        for line in hlo.splitlines()
    )
    if calls:
        return calls
    return sum(" dot(" in line and "f8e" in line for line in hlo.splitlines())


def _batch(key, teacher, batch_size):
    features = teacher.shape[0]
    rows = jnp.where(jnp.arange(batch_size) % 7 == 0, 100.0, 1.0)[:, None]
    x = jax.random.normal(key, (batch_size, features)) * rows
    return {"x": x, "y": jnp.tanh(x / 10 @ teacher), "w": jnp.ones((batch_size,))}
