"""The window's time and temporaries against the full batch's, per model
class (issue 73): the promise is the big batch's speed, not only a peer's.

Run: python benchmarks/model_classes.py [--quick]
(writes benchmarks/results/model_classes.json; about 15 minutes on 2 CPU
cores; ``--quick``: small shapes, one round, N = 2 only, the peers on the
ResNet-style class only, written nowhere).
On an accelerator: ``python benchmarks/gpu.py --model-classes`` (the same
matrix, with ``conv_layout="canonical"`` as a contender too, since
``"auto"`` rewrites only on CPU; ``--smoke`` runs it on CPU).

Classes (plain JAX, float32; B = 64 images, 4096 MLP rows or bags, 1024
sequences or pairs): an MLP; a ResNet-style CNN (3x3
convolutions in residual stages) without normalisation, with micro-batch
BatchNorm, and with the window's statistics through ``axis_name``; a
MobileNet-style stack (strided 3x3, depthwise 3x3, pointwise 1x1); a
U-Net-style network (strided convolution down, transposed convolution up, a
skip); a causal transformer block; an embedding bag (50k x 64); a recurrent
model (``lax.scan`` over 32 steps); a two-tower contrastive model through
``cached_value_and_grad``.

Contenders at N in {2, 8}, each one value-and-gradient step of the whole
batch: ``full`` (``jax.value_and_grad``), ``window``
(``jaxaccum.value_and_grad(loss, N)``, its defaults: convolutions in the
loop in the fast kernel's layout on CPU), ``window_traced`` (the same with
``conv_layout="traced"``: the window before issue 73), ``unroll``
(``unroll=True``), ``optax_microbatching`` (``optax.microbatching.microbatch``
of ``jax.value_and_grad`` with the MEAN accumulator: its fastest
configuration, it has no other) and ``multisteps`` (``optax.MultiSteps`` as
a host loop: N jitted calls of one micro-batch's gradient and the
transformation's update). Time: rounds of three steps each, the contenders
in turn within a round (min / median / max, and the median of the rounds'
ratios to ``full``). Temporaries: ``memory_analysis().temp_size_in_bytes``.
"""

import argparse
import dataclasses
import functools
import json
import pathlib
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from cached import interleaved_seconds
from common import against_full, spread, write_json
from jax import lax

import jaxaccum

AXIS = "window"
DN = ("NHWC", "HWIO", "NHWC")
# The figures at N = 8: the window within 1.10x the full batch's
# time and no slower than optax.microbatching.
BOUNDS = {"window_over_full": 1.10, "window_over_optax": 1.0}


@dataclasses.dataclass(frozen=True)
class ModelClass:
    """A loss, its parameters and batch, and how the window takes it."""

    loss: Callable
    params: dict
    batch: dict
    options: dict = dataclasses.field(default_factory=dict)
    coupled: bool = False  # statistics over the batch: no per-micro-batch peer


def _normal(key, shape, scale):
    return jax.random.normal(key, shape, jnp.float32) * scale


def conv(x, kernel, stride=1, groups=1):
    return lax.conv_general_dilated(
        x,
        kernel,
        (stride, stride),
        "SAME",
        dimension_numbers=DN,
        feature_group_count=groups,
    )


def batch_norm(x, axis_name=None):
    """Normalises over the batch and the spatial axes (micro-batch
    statistics, or the window's through ``axis_name``)."""
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axes)
    square = jnp.mean(x**2, axes)
    if axis_name is not None:
        mean, square = lax.pmean((mean, square), axis_name)
    return (x - mean) * lax.rsqrt(square - mean**2 + 1e-5)


def _images(key, size, batch_size, channels=3):
    keys = jax.random.split(key, 2)
    return {
        "x": _normal(keys[0], (batch_size, size, size, channels), 1.0),
        "y": jax.random.randint(keys[1], (batch_size,), 0, 10),
    }


def _classify(logits, labels):
    return -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1)
    )


def resnet(size, width, batch_size, norm=None):
    """Three residual stages of two 3x3 convolutions each, strided between
    stages; ``norm``: None, "micro" or "axis" (a BatchNorm after each)."""
    keys = iter(jax.random.split(jax.random.key(0), 16))
    widths = (width, 2 * width, 4 * width)
    params = {"stem": _normal(next(keys), (3, 3, 3, width), 0.2)}
    for stage, (c_in, c_out) in enumerate(
        zip((width, *widths[:-1]), widths, strict=True)
    ):
        params[f"down{stage}"] = _normal(next(keys), (3, 3, c_in, c_out), 0.1)
        params[f"a{stage}"] = _normal(next(keys), (3, 3, c_out, c_out), 0.05)
        params[f"b{stage}"] = _normal(next(keys), (3, 3, c_out, c_out), 0.05)
    params["head"] = _normal(next(keys), (widths[-1], 10), 0.1)
    axis = AXIS if norm == "axis" else None

    def normed(x):
        return x if norm is None else batch_norm(x, axis)

    def loss(params, batch):
        h = jax.nn.relu(normed(conv(batch["x"], params["stem"])))
        for stage in range(3):
            h = jax.nn.relu(
                normed(conv(h, params[f"down{stage}"], 1 if stage == 0 else 2))
            )
            inner = jax.nn.relu(normed(conv(h, params[f"a{stage}"])))
            h = jax.nn.relu(h + normed(conv(inner, params[f"b{stage}"])))
        return _classify(jnp.mean(h, (1, 2)) @ params["head"], batch["y"])

    options = {"axis_name": AXIS} if norm == "axis" else {}
    return ModelClass(
        loss,
        params,
        _images(jax.random.key(1), size, batch_size),
        options,
        norm is not None,
    )


def mobilenet(size, width, batch_size):
    """A strided 3x3 stem, then blocks of a depthwise 3x3 and a pointwise 1x1."""
    keys = iter(jax.random.split(jax.random.key(2), 12))
    params = {"stem": _normal(next(keys), (3, 3, 3, width), 0.2)}
    for block in range(4):
        params[f"depth{block}"] = _normal(next(keys), (3, 3, 1, width), 0.3)
        params[f"point{block}"] = _normal(next(keys), (1, 1, width, width), 0.2)
    params["head"] = _normal(next(keys), (width, 10), 0.1)

    def loss(params, batch):
        h = jax.nn.relu(conv(batch["x"], params["stem"], 2))
        for block in range(4):
            h = jax.nn.relu(
                conv(h, params[f"depth{block}"], 1 + block % 2, groups=width)
            )
            h = jax.nn.relu(conv(h, params[f"point{block}"]))
        return _classify(jnp.mean(h, (1, 2)) @ params["head"], batch["y"])

    return ModelClass(loss, params, _images(jax.random.key(3), size, batch_size))


def unet(size, width, batch_size):
    """Down by a strided convolution, a convolution, up by a transposed
    convolution, a skip, a per-pixel output."""
    keys = iter(jax.random.split(jax.random.key(4), 6))
    params = {
        "in": _normal(next(keys), (3, 3, 3, width), 0.2),
        "down": _normal(next(keys), (3, 3, width, 2 * width), 0.1),
        "mid": _normal(next(keys), (3, 3, 2 * width, 2 * width), 0.05),
        "up": _normal(next(keys), (3, 3, 2 * width, width), 0.1),
        "out": _normal(next(keys), (1, 1, 2 * width, 1), 0.1),
    }

    def loss(params, batch):
        skip = jax.nn.relu(conv(batch["x"], params["in"]))
        h = jax.nn.relu(conv(skip, params["down"], 2))
        h = jax.nn.relu(conv(h, params["mid"]))
        h = lax.conv_transpose(h, params["up"], (2, 2), "SAME", dimension_numbers=DN)
        out = conv(jnp.concatenate([jax.nn.relu(h), skip], -1), params["out"])
        return jnp.mean((out[..., 0] - batch["x"][..., 0]) ** 2)

    return ModelClass(loss, params, _images(jax.random.key(5), size, batch_size))


def mlp(batch_size, width):
    keys = jax.random.split(jax.random.key(6), 5)
    params = {
        "w1": _normal(keys[0], (256, width), 0.06),
        "w2": _normal(keys[1], (width, width), 0.03),
        "w3": _normal(keys[2], (width, 10), 0.03),
    }
    batch = {
        "x": _normal(keys[3], (batch_size, 256), 1.0),
        "y": jax.random.randint(keys[4], (batch_size,), 0, 10),
    }

    def loss(params, batch):
        h = jax.nn.gelu(batch["x"] @ params["w1"])
        h = jax.nn.gelu(h @ params["w2"])
        return _classify(h @ params["w3"], batch["y"])

    return ModelClass(loss, params, batch)


def transformer(batch_size, seq, dim, heads=4):
    keys = jax.random.split(jax.random.key(7), 6)
    params = {
        "qkv": _normal(keys[0], (dim, 3 * dim), dim**-0.5),
        "proj": _normal(keys[1], (dim, dim), dim**-0.5),
        "up": _normal(keys[2], (dim, 4 * dim), dim**-0.5),
        "down": _normal(keys[3], (4 * dim, dim), (4 * dim) ** -0.5),
    }
    batch = {
        "x": _normal(keys[4], (batch_size, seq, dim), 1.0),
        "y": _normal(keys[5], (batch_size, seq, dim), 1.0),
    }

    def loss(params, batch):
        x = batch["x"]
        q, k, v = jnp.split(x @ params["qkv"], 3, -1)
        split = lambda t: t.reshape(*t.shape[:2], heads, -1)  # noqa: E731
        scores = (
            jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (dim // heads) ** 0.5
        )
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v)).reshape(x.shape)
        h = x + attended @ params["proj"]
        h = h + jax.nn.gelu(h @ params["up"]) @ params["down"]
        return jnp.mean((h - batch["y"]) ** 2)

    return ModelClass(loss, params, batch)


def embedding_bag(batch_size, vocab=50_000, dim=64, bag=32):
    keys = jax.random.split(jax.random.key(8), 4)
    params = {
        "table": _normal(keys[0], (vocab, dim), 0.1),
        "head": _normal(keys[1], (dim, 10), 0.1),
    }
    batch = {
        "ids": jax.random.randint(keys[2], (batch_size, bag), 0, vocab),
        "y": jax.random.randint(keys[3], (batch_size,), 0, 10),
    }

    def loss(params, batch):
        bags = jnp.mean(params["table"][batch["ids"]], 1)
        return _classify(bags @ params["head"], batch["y"])

    return ModelClass(loss, params, batch)


def recurrent(batch_size, steps=32, dim=128):
    keys = jax.random.split(jax.random.key(9), 5)
    params = {
        "in": _normal(keys[0], (32, dim), 0.2),
        "hidden": _normal(keys[1], (dim, dim), dim**-0.5),
        "head": _normal(keys[2], (dim, 10), 0.1),
    }
    batch = {
        "x": _normal(keys[3], (batch_size, steps, 32), 1.0),
        "y": jax.random.randint(keys[4], (batch_size,), 0, 10),
    }

    def loss(params, batch):
        def step(h, x):
            return jnp.tanh(x @ params["in"] + h @ params["hidden"]), None

        inputs = jnp.swapaxes(batch["x"], 0, 1)
        h, _ = lax.scan(step, jnp.zeros((inputs.shape[1], dim)), inputs)
        return _classify(h @ params["head"], batch["y"])

    return ModelClass(loss, params, batch)


def two_tower(batch_size, dim=128):
    keys = jax.random.split(jax.random.key(10), 4)
    params = {
        "image": _normal(keys[0], (256, dim), 0.06),
        "text": _normal(keys[1], (256, dim), 0.06),
    }
    batch = {
        "image": _normal(keys[2], (batch_size, 256), 1.0),
        "text": _normal(keys[3], (batch_size, 256), 1.0),
    }

    def encode(params, batch):
        return {t: jnp.tanh(batch[t] @ params[t]) for t in ("image", "text")}

    def contrastive(params, outputs):
        return jaxaccum.losses.softmax_contrastive(
            outputs["image"], outputs["text"], 10.0
        )

    def loss(params, batch):
        return contrastive(params, encode(params, batch))

    return ModelClass(loss, params, batch, {"cached": (encode, contrastive)}, True)


def classes(quick: bool) -> dict[str, ModelClass]:
    """Each class at a batch whose activations outweigh its parameters (what
    accumulation is for): B = 64 images, 4096 MLP rows or bags, 1024
    sequences or pairs."""
    size, width, images = (16, 8, 16) if quick else (32, 16, 64)
    rows = 64 if quick else 4096
    return {
        "mlp": mlp(rows, 128 if quick else 512),
        "resnet": resnet(size, width, images),
        "resnet_micro_bn": resnet(size, width, images, "micro"),
        "resnet_axis_bn": resnet(size, width, images, "axis"),
        "mobilenet": mobilenet(size, 2 * width, images),
        "unet": unet(size, width, images),
        "transformer": transformer(images, 16 if quick else 64, 32 if quick else 128),
        "embedding_bag": embedding_bag(rows, 1_000 if quick else 50_000),
        "recurrent": recurrent(rows // 4, 8 if quick else 32),
        "two_tower": two_tower(rows // 4),
    }


def _whole_batch(model: ModelClass) -> Callable:
    """The full batch's loss: as the axis's one member for ``axis_name``."""
    if "axis_name" not in model.options:
        return model.loss

    def loss(params, batch):
        one = jax.tree.map(lambda x: x[None], batch)
        return jax.vmap(model.loss, (None, 0), axis_name=AXIS)(params, one)[0]

    return loss


def _multisteps(model: ModelClass, num: int) -> Callable:
    """``optax.MultiSteps`` as a host loop: N jitted calls, each one
    micro-batch's gradient and the transformation's update."""
    optimizer = optax.MultiSteps(optax.sgd(0.1), num)

    @jax.jit
    def call(params, state, micro):
        value, grads = jax.value_and_grad(model.loss)(params, micro)
        updates, state = optimizer.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    state = optimizer.init(model.params)
    micro = [jax.tree.map(lambda x, k=k: x[k::num], model.batch) for k in range(num)]

    def window(params, batch):
        out, opt_state = None, state
        for one in micro:
            out, _, opt_state = call(params, opt_state, one)
        return out

    window.memory = call.lower(model.params, state, micro[0]).compile()
    return window


def contenders(model: ModelClass, num: int, peers: bool = True) -> dict[str, Callable]:
    """Each contender's step, jitted (the host loop: a Python function);
    without ``peers``, the full batch and the window (either layout) only."""
    steps: dict[str, Callable] = {
        "full": jax.jit(jax.value_and_grad(_whole_batch(model)))
    }
    if "cached" in model.options:
        encode, loss = model.options["cached"]
        steps["window"] = jax.jit(jaxaccum.cached_value_and_grad(encode, loss, num))
        return steps
    options = {k: v for k, v in model.options.items() if k != "cached"}
    window = functools.partial(jaxaccum.value_and_grad, model.loss, num, **options)
    steps["window"] = jax.jit(window())
    steps["window_traced"] = jax.jit(window(conv_layout="traced"))
    if jax.default_backend() != "cpu":  # "auto" rewrites on CPU only
        steps["window_canonical"] = jax.jit(window(conv_layout="canonical"))
    if not peers:
        return steps
    steps["unroll"] = jax.jit(window(unroll=True))
    if "axis_name" not in model.options:
        steps["optax_microbatching"] = jax.jit(
            optax.microbatching.microbatch(
                jax.value_and_grad(model.loss),
                argnums=1,
                microbatch_size=len(jax.tree.leaves(model.batch)[0]) // num,
                accumulator=optax.microbatching.AccumulationType.MEAN,
            )
        )
        steps["multisteps"] = _multisteps(model, num)
    return steps


def _compiled(step: Callable, model: ModelClass):
    compiled = getattr(step, "memory", None)
    if compiled is None:
        compiled = step.lower(model.params, model.batch).compile()
    return compiled


def instructions(compiled) -> list[str]:
    """The compiled program's instructions, their names and source metadata
    left out: two steps with equal lists run the same program."""
    return [
        re.sub(r"%[\w.-]+|, metadata=\{[^}]*\}", "%", line)
        for line in compiled.as_text().splitlines()
        if " = " in line
    ]


def measure(model: ModelClass, num: int, rounds: int, peers: bool = True) -> dict:
    steps = contenders(model, num, peers)
    times = interleaved_seconds(steps, (model.params, model.batch), rounds)
    compiled = {name: _compiled(step, model) for name, step in steps.items()}
    temps = {
        name: program.memory_analysis().temp_size_in_bytes
        for name, program in compiled.items()
    }
    result = against_full(times, temps)
    if "window_traced" in compiled:  # without convolutions: the same program
        result["same_program_as_traced"] = instructions(
            compiled["window"]
        ) == instructions(compiled["window_traced"])
    for peer, key in (("optax_microbatching", "optax"), ("window_traced", "traced")):
        if peer in times:  # round by round: a round's contenders share its load
            ratios = np.asarray(times["window"]) / np.asarray(times[peer])
            result[f"window_over_{key}"] = spread([float(r) for r in ratios])
    return result


def holds(result: dict) -> dict:
    """The issue's figures at N = 8 for one class."""
    checks = {
        "window_over_full": bool(
            result["over_full"]["window"]["median"] <= BOUNDS["window_over_full"]
        )
    }
    if "window_over_optax" in result:
        checks["window_over_optax"] = bool(
            result["window_over_optax"]["median"] <= BOUNDS["window_over_optax"]
        )
    if "window_traced" in result["temp_bytes"]:
        checks["temp_no_larger"] = bool(
            result["temp_bytes"]["window"] <= result["temp_bytes"]["window_traced"]
        )
        # No slower than before issue 73: the same program, or faster.
        checks["no_slower_than_traced"] = bool(
            result["same_program_as_traced"]
            or result["window_over_traced"]["median"] <= 1.0
        )
    return checks


def run(quick: bool, rounds: int) -> dict:
    """Every class at N in {2, 8} (``quick``: N = 2), printed as it goes."""
    results: dict = {}
    for name, model in classes(quick).items():
        for num in (2,) if quick else (2, 8):
            # The smoke run times the peers on one class: every contender runs.
            result = measure(model, num, rounds, peers=not quick or name == "resnet")
            if num == 8:
                result["holds"] = holds(result)
            results[f"{name}_n{num}"] = result
            window = result["over_full"]["window"]["median"]
            traced = result["over_full"].get("window_traced", {}).get("median")
            print(
                f"{name:16s} N={num}: window/full {window:5.2f}x"
                + ("" if traced is None else f" (conv_layout='traced' {traced:5.2f}x)")
                + f", temporaries {result['temp_over_full']['window']:.3f}x",
                flush=True,
            )
    return {
        "backend": jax.default_backend(),
        "bounds": BOUNDS,
        "rounds": rounds,
        "results": results,
    }


def main(argv: list[str] | None = None, name: str = "model_classes") -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, 1 round, no file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results file")
    args = parser.parse_args(argv)
    payload = run(args.quick, 1 if args.quick else args.rounds)
    if args.out is not None:
        from jaxaccum.cli.harness import machine

        args.out.write_text(
            json.dumps({"machine": machine(), **payload}, indent=2) + "\n"
        )
        print(args.out)
    elif not args.quick:
        print(write_json(name, payload))


if __name__ == "__main__":
    main()
