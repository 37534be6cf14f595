"""Which operations run slower inside the window's loop than in the full
batch's program (issue 73, item 2): XLA:CPU compiles some instructions into
slower kernels inside a while loop's body than in the entry computation (the
known case: the kernel gradient's convolution, which ``conv_layout="auto"``
rewrites). This sweep times the other operations a model's gradient uses.

Run: python benchmarks/loop_ops.py [--quick] [--only OP ...]
(writes benchmarks/results/loop_ops.json; about 4 minutes on 2 CPU cores;
``--quick``: one round, written nowhere, about 1.5 minutes; ``--only``: those
operations).

Operations (float32, B = 64; each a small loss ``loss(params, batch)`` whose
gradient runs the operation and its transpose): convolutions (3x3 NHWC/HWIO,
two layers so both the input's and the kernel's gradient run; grouped,
depthwise, dilated, strided, transposed, 1-D), max pooling (its gradient a
select-and-scatter), average pooling, an embedding lookup (50k x 64, its
gradient a scatter-add), ``jnp.cumsum`` along the sequence, ``jnp.sort``
(its gradient a gather), a spectral filter (``rfft`` / ``irfft``),
attention's batched dots with a softmax, layer norm, and
``take_along_axis`` (a gather, its gradient a scatter-add into an
activation).

Contenders, each one jitted value-and-gradient step of the whole batch:
``full`` (``jax.value_and_grad``), ``window``
(``jaxaccum.value_and_grad(loss, 8)``, its defaults), ``window_traced``
(the same with ``conv_layout="traced"``) and ``unroll`` (a plain
``lax.scan`` over the 8 micro-batches with ``unroll=True``: no loop left,
what splitting the batch costs by itself). Time: 5 rounds of three steps
each, the contenders in turn within a round (min / median / max, and the
rounds' ratios to ``full``). Temporaries:
``memory_analysis().temp_size_in_bytes``.
"""

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
from cached import interleaved_seconds
from common import against_full, write_json
from jax import lax

import jaxaccum

NUM = 8
BATCH = 64
DN = ("NHWC", "HWIO", "NHWC")
# A window this much slower than the full batch is read as slow in the loop.
SLOW = 1.15

Case = tuple[Callable, dict, dict]


def _normal(key: jax.Array, shape: tuple, scale: float = 1.0) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * scale


def _keys(seed: int, count: int = 4) -> list[jax.Array]:
    return list(jax.random.split(jax.random.key(seed), count))


def _square(h: jax.Array) -> jax.Array:
    return jnp.mean(h**2)


def _conv_case(size, c_in, c_out, window=3, groups=1, **conv) -> Case:
    """Two convolutions (both the input's and the kernel's gradients run);
    ``conv``: ``lax.conv_general_dilated``'s options for both."""
    keys = _keys(size + c_in + groups, 3)
    spatial, dn, shape = (window, window), DN, (BATCH, size, size, c_in)
    if conv.pop("one_d", False):
        spatial, dn, shape = (window,), ("NWC", "WIO", "NWC"), (BATCH, size, c_in)
    params = {
        "a": _normal(keys[0], (*spatial, c_in // groups, c_out), 0.1),
        "b": _normal(keys[1], (*spatial, c_out // groups, c_out), 0.05),
    }
    strides = conv.pop("strides", 1)

    def apply(x, kernel):
        return lax.conv_general_dilated(
            x,
            kernel,
            (strides,) * len(spatial),
            "SAME",
            dimension_numbers=dn,
            feature_group_count=groups,
            **conv,
        )

    def loss(params, batch):
        return _square(apply(jax.nn.relu(apply(batch["x"], params["a"])), params["b"]))

    return loss, params, {"x": _normal(keys[2], shape)}


def _transposed_case(size: int, channels: int) -> Case:
    """A strided convolution down, a transposed convolution back up."""
    keys = _keys(11, 3)
    params = {
        "down": _normal(keys[0], (3, 3, channels, 2 * channels), 0.1),
        "up": _normal(keys[1], (3, 3, 2 * channels, channels), 0.05),
    }

    def loss(params, batch):
        h = lax.conv_general_dilated(
            batch["x"], params["down"], (2, 2), "SAME", dimension_numbers=DN
        )
        up = lax.conv_transpose(
            jax.nn.relu(h), params["up"], (2, 2), "SAME", dimension_numbers=DN
        )
        return _square(up)

    return loss, params, {"x": _normal(keys[2], (BATCH, size, size, channels))}


def _scaled(seed: int, shape: tuple) -> tuple[dict, dict]:
    """A per-feature scale and shift (the parameters an op without its own
    sees its gradient through) and an activation of ``shape``."""
    keys = _keys(seed, 3)
    params = {
        "scale": 1.0 + _normal(keys[0], shape[-1:], 0.1),
        "shift": _normal(keys[1], shape[-1:], 0.1),
    }
    return params, {"x": _normal(keys[2], shape)}


def _pool_case(reducer: str, size: int, channels: int) -> Case:
    params, batch = _scaled(12, (BATCH, size, size, channels))
    window, strides = (1, 3, 3, 1), (1, 2, 2, 1)

    def loss(params, batch):
        h = jnp.tanh(batch["x"] * params["scale"] + params["shift"])
        if reducer == "max":
            out = lax.reduce_window(h, -jnp.inf, lax.max, window, strides, "SAME")
        else:
            out = lax.reduce_window(h, 0.0, lax.add, window, strides, "SAME") / 9
        return _square(out)

    return loss, params, batch


def _sequence_case(op: str, seq: int, dim: int) -> Case:
    """An elementwise op without parameters of its own on (B, T, D)."""
    params, batch = _scaled(13, (BATCH, seq, dim))
    if op == "fft":
        params["filter"] = jnp.ones((seq // 2 + 1, dim), jnp.complex64)
    if op == "take_along_axis":
        batch["index"] = jax.random.randint(
            jax.random.key(14), (BATCH, seq, dim), 0, seq
        )

    def loss(params, batch):
        h = jnp.tanh(batch["x"] * params["scale"] + params["shift"])
        if op == "cumsum":
            out = jnp.cumsum(h, axis=1) / seq
        elif op == "sort":
            out = jnp.sort(h, axis=1) * jnp.linspace(-1, 1, seq)[:, None]
        elif op == "fft":
            spectrum = jnp.fft.rfft(h, axis=1) * params["filter"]
            out = jnp.fft.irfft(spectrum, n=seq, axis=1)
        elif op == "layer_norm":
            out = jax.nn.standardize(batch["x"], axis=-1) * params["scale"]
            out = out + params["shift"]
        else:
            out = jnp.take_along_axis(h, batch["index"], axis=1)
        return _square(out - 0.5)

    return loss, params, batch


def _attention_case(seq: int, dim: int) -> Case:
    """Batched dots around a softmax; the projections per feature only, so
    the dots are what the step costs."""
    keys = _keys(15, 4)
    params = {name: 1.0 + _normal(keys[i], (dim,), 0.1) for i, name in enumerate("qkv")}

    def loss(params, batch):
        x = batch["x"]
        q, k, v = (x * params[name] for name in "qkv")
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / dim**0.5
        out = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), v)
        return _square(out)

    return loss, params, {"x": _normal(keys[3], (BATCH, seq, dim))}


def _embedding_case(vocab: int, dim: int, bag: int) -> Case:
    keys = _keys(16, 2)
    params = {"table": _normal(keys[0], (vocab, dim), 0.1)}
    batch = {"ids": jax.random.randint(keys[1], (BATCH * 16, bag), 0, vocab)}

    def loss(params, batch):
        return _square(jnp.tanh(params["table"][batch["ids"]]).sum(1))

    return loss, params, batch


def cases() -> dict[str, Case]:
    """Each operation sized so a full-batch step takes 20-200 ms on 2 cores."""
    return {
        "conv": _conv_case(16, 32, 32),
        "conv_grouped": _conv_case(8, 32, 32, groups=8),
        "conv_depthwise": _conv_case(16, 16, 16, groups=16),
        "conv_dilated": _conv_case(16, 32, 32, rhs_dilation=(2, 2)),
        "conv_strided": _conv_case(32, 32, 32, strides=2),
        "conv_transposed": _transposed_case(16, 32),
        "conv_1d": _conv_case(128, 64, 64, window=5, one_d=True),
        "max_pool": _pool_case("max", 32, 32),
        "avg_pool": _pool_case("avg", 64, 32),
        "embedding": _embedding_case(50_000, 64, 32),
        "cumsum": _sequence_case("cumsum", 256, 128),
        "sort": _sequence_case("sort", 256, 32),
        "fft": _sequence_case("fft", 256, 128),
        "attention": _attention_case(256, 64),
        "layer_norm": _sequence_case("layer_norm", 256, 256),
        "take_along_axis": _sequence_case("take_along_axis", 256, 128),
    }


def unrolled(loss: Callable, num: int) -> Callable:
    """A plain ``lax.scan`` over ``num`` contiguous micro-batches, unrolled:
    the mean of their values and gradients."""
    value_and_grad = jax.value_and_grad(loss)

    def step(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(num, -1, *x.shape[1:]), batch)

        def body(total, one):
            return jax.tree.map(jnp.add, total, value_and_grad(params, one)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
        total, _ = lax.scan(body, zero, micro, unroll=True)
        return jax.tree.map(lambda t: t / num, total)

    return step


def contenders(loss: Callable) -> dict[str, Callable]:
    return {
        "full": jax.jit(jax.value_and_grad(loss)),
        "window": jax.jit(jaxaccum.value_and_grad(loss, NUM)),
        "window_traced": jax.jit(
            jaxaccum.value_and_grad(loss, NUM, conv_layout="traced")
        ),
        "unroll": jax.jit(unrolled(loss, NUM)),
    }


def measure(case: Case, rounds: int) -> dict:
    loss, params, batch = case
    steps = contenders(loss)
    temps = {
        name: step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        for name, step in steps.items()
    }
    times = interleaved_seconds(steps, (params, batch), rounds)
    return against_full(times, temps)


def run(rounds: int, only: list[str] | None) -> dict:
    """Every operation, printed as it goes."""
    results = {}
    for name, case in cases().items():
        if only and name not in only:
            continue
        result = measure(case, rounds)
        results[name] = result
        ratio = {k: v["median"] for k, v in result["over_full"].items()}
        mib = {k: v / 2**20 for k, v in result["temp_bytes"].items()}
        print(
            f"{name:16s} full {result['seconds']['full']['median'] * 1e3:6.1f} ms;"
            f" window {ratio['window']:5.2f}x, traced {ratio['window_traced']:5.2f}x,"
            f" unroll {ratio['unroll']:5.2f}x; temporaries MiB window"
            f" {mib['window']:.1f}, traced {mib['window_traced']:.1f},"
            f" full {mib['full']:.1f}",
            flush=True,
        )
    slow = [
        name
        for name, result in results.items()
        if max(
            result["over_full"]["window"]["median"],
            result["over_full"]["window_traced"]["median"],
        )
        > SLOW
    ]
    return {
        "backend": jax.default_backend(),
        "num_microbatches": NUM,
        "batch_size": BATCH,
        "rounds": rounds,
        "slow_bound": SLOW,
        "slow_in_loop": slow,
        "results": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, no file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="these operations only")
    args = parser.parse_args(argv)
    payload = run(1 if args.quick else args.rounds, args.only)
    if not args.quick and not args.only:
        print(write_json("loop_ops", payload))


if __name__ == "__main__":
    main()
