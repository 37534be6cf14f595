"""The window as a named axis (``axis_name=``) against micro-batch statistics,
the full batch and ``cached_value_and_grad``: compiled temporaries, FLOPs and
time of one step.

Run: python benchmarks/axis.py [--quick]
(writes benchmarks/results/axis.json; a few minutes on 2 CPU cores,
``--quick`` smaller shapes and two rounds, written nowhere).

Four questions, each with the issue's figure (issue 67):

- ``mlp``: residual MLP blocks (width 512, hidden 2048, GELU; 8 blocks) at
  B = 4096, N = 16, a BatchNorm over the window before every 8th block or
  before every block: temporaries against the full batch (at most 0.12x and
  0.5x), FLOPs against micro-batch statistics (the same model with
  each micro-batch's statistics, plain accumulation; at most 1.40x: one
  recomputed forward);
- ``no_collective``: the same blocks without a collective over the axis:
  ``axis_name`` compiles today's window (at most 1.02x its FLOPs, 1.05x its
  temporaries);
- ``clip``: in-batch negatives written for data parallelism (an
  ``all_gather`` of the text tower's embeddings, the positive found by
  ``axis_index``) against ``cached_value_and_grad`` with the blockwise
  ``softmax_contrastive`` (B = 2048, N = 16): temporaries at most 1.25x,
  time at most 1.15x;
- ``cnn``: a small ResNet-style CNN (three residual stages of 3x3
  convolutions) with a BatchNorm after every convolution, and one with a
  BatchNorm only in its projection head: the window's statistics against
  micro-batch statistics and the full batch, temporaries, FLOPs and time.

Temporaries: ``compiled.memory_analysis().temp_size_in_bytes`` of the
programs as run (scans rolled). FLOPs: ``compiled.cost_analysis()['flops']``
of the same programs compiled with ``unroll=True`` and without CSE, because
XLA's cost analysis counts a loop body once whatever its trip count. Time:
rounds of three steps, each round timing the contenders in turn (min /
median / max, and the median of each round's ratio: a round's contenders see
the same load).
"""

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from cached import counted, interleaved_seconds
from common import spread, write_json
from jax import lax

import jaxaccum

AXIS = "window"
BOUNDS = {
    "mlp_every_8_temp_over_full": 0.12,
    "mlp_every_block_temp_over_full": 0.5,
    "flops_over_plain": 1.40,
    "no_collective_flops": 1.02,
    "no_collective_temp": 1.05,
    "clip_temp_over_cached": 1.25,
    "clip_seconds_over_cached": 1.15,
}


def batchnorm(h: jax.Array, window: bool, axes: tuple = (0,)) -> jax.Array:
    """BatchNorm without parameters: over the window's axis or the batch."""
    mean = jnp.mean(h, axes)
    square = jnp.mean(h * h, axes)
    if window:
        mean, square = lax.pmean((mean, square), AXIS)
    return (h - mean) * lax.rsqrt(square - mean**2 + 1e-5)


def mlp_loss(every: int | None, window: bool) -> Callable:
    """Residual blocks ``h + W2 gelu(W1 norm(h))``, a BatchNorm before every
    ``every``-th block (None: none)."""

    def loss(params: list, batch: dict) -> jax.Array:
        h = batch["x"]
        for index, (w1, w2) in enumerate(params):
            normed = h
            if every is not None and (index + 1) % every == 0:
                normed = batchnorm(h, window)
            h = h + jax.nn.gelu(normed @ w1) @ w2
        return jnp.mean((h - batch["y"]) ** 2)

    return loss


def temp_bytes(fun: Callable, *args) -> int:
    compiled = jax.jit(fun).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def mlp_rows(width: int, batch_size: int, num: int, blocks: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 2 * blocks + 2)
    params = [
        (
            jax.random.normal(keys[2 * i], (width, 4 * width)) / np.sqrt(width),
            jax.random.normal(keys[2 * i + 1], (4 * width, width)) / np.sqrt(4 * width),
        )
        for i in range(blocks)
    ]
    batch = {
        "x": jax.random.normal(keys[-2], (batch_size, width)),
        "y": jax.random.normal(keys[-1], (batch_size, width)),
    }
    rows = []
    for every in (blocks, 1, None):
        full = jax.value_and_grad(mlp_loss(every, False))
        plain = jaxaccum.value_and_grad(mlp_loss(every, False), num)
        named = jaxaccum.value_and_grad(mlp_loss(every, True), num, axis_name=AXIS)
        # Each segment checkpointed, recomputed whole (what crosses included).
        recomputed = jaxaccum.value_and_grad(
            mlp_loss(every, True),
            num,
            axis_name=AXIS,
            remat=jax.checkpoint_policies.nothing_saveable,
        )
        unrolled = {"unroll": True}
        row = {
            "batchnorm_every": every,
            "full_temp_bytes": temp_bytes(full, params, batch),
            "plain_temp_bytes": temp_bytes(plain, params, batch),
            "axis_temp_bytes": temp_bytes(named, params, batch),
            "axis_recomputed_temp_bytes": temp_bytes(recomputed, params, batch),
            "plain_flops": counted(
                jaxaccum.value_and_grad(mlp_loss(every, False), num, **unrolled),
                params,
                batch,
            ),
            "axis_flops": counted(
                jaxaccum.value_and_grad(
                    mlp_loss(every, True), num, axis_name=AXIS, **unrolled
                ),
                params,
                batch,
            ),
        }
        row["axis_temp_over_full"] = row["axis_temp_bytes"] / row["full_temp_bytes"]
        row["plain_temp_over_full"] = row["plain_temp_bytes"] / row["full_temp_bytes"]
        row["axis_recomputed_temp_over_full"] = (
            row["axis_recomputed_temp_bytes"] / row["full_temp_bytes"]
        )
        row["axis_temp_over_plain"] = row["axis_temp_bytes"] / row["plain_temp_bytes"]
        row["axis_flops_over_plain"] = row["axis_flops"] / row["plain_flops"]
        rows.append(row)
        print(
            f"mlp BatchNorm every {every}: temporaries full "
            f"{row['full_temp_bytes'] / 2**20:.1f} MiB, axis "
            f"{row['axis_temp_over_full']:.3f}x full (micro-batch statistics "
            f"{row['plain_temp_over_full']:.3f}x), FLOPs "
            f"{row['axis_flops_over_plain']:.3f}x plain"
        )
    return rows


def clip_gathered(params: dict, batch: dict) -> jax.Array:
    """CLIP's symmetric loss written for data parallelism: each member's rows
    against the window's other tower (gathered), the positive at
    ``axis_index * rows + row``; the window's mean is the big batch's."""
    from cached import encode

    outputs = encode(params, batch)
    image, text = outputs["image"], outputs["text"]
    images = lax.all_gather(image, AXIS, tiled=True)
    texts = lax.all_gather(text, AXIS, tiled=True)
    scale = jnp.exp(params["log_scale"])
    rows = image.shape[0]
    labels = lax.axis_index(AXIS) * rows + jnp.arange(rows)

    def cross_entropy(logits: jax.Array) -> jax.Array:
        picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)

    return (
        cross_entropy(scale * image @ texts.T) + cross_entropy(scale * text @ images.T)
    ) / 2


def clip_row(hidden: int, batch_size: int, num: int, rounds: int) -> dict:
    from cached import FEATURES, TOWERS, clip, encode, init

    params = init(jax.random.key(0), hidden)
    keys = jax.random.split(jax.random.key(1), len(TOWERS))
    batch = {
        t: jax.random.normal(k, (batch_size, FEATURES))
        for t, k in zip(TOWERS, keys, strict=True)
    }
    contenders = {
        "cached": jaxaccum.cached_value_and_grad(
            encode, clip(jaxaccum.losses.softmax_contrastive), num
        ),
        "axis": jaxaccum.value_and_grad(clip_gathered, num, axis_name=AXIS),
    }
    args = (params, batch)
    compiled = {n: jax.jit(f).lower(*args).compile() for n, f in contenders.items()}
    cached_out, axis_out = (jax.jit(f)(*args) for f in contenders.values())
    agree = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(cached_out), jax.tree.leaves(axis_out), strict=True
        )
    )
    loss = clip(jaxaccum.losses.softmax_contrastive)
    full = jax.value_and_grad(lambda p, b: loss(p, encode(p, b)))
    compiled["full"] = jax.jit(full).lower(*args).compile()
    times = interleaved_seconds(compiled, args, rounds)
    paired = [a / c for a, c in zip(times["axis"], times["cached"], strict=True)]
    row = {
        "batch_size": batch_size,
        "num_microbatches": num,
        "max_abs_difference": agree,
        "axis_over_cached_seconds_per_round": spread(paired),
    }
    for name in ("axis", "cached"):  # against the full batch, round by round
        over = [a / f for a, f in zip(times[name], times["full"], strict=True)]
        row[f"{name}_over_full_seconds_per_round"] = spread(over)
    for name in compiled:
        row[name] = {
            "seconds": spread(times[name]),
            "temp_bytes": compiled[name].memory_analysis().temp_size_in_bytes,
        }
    row["axis_temp_over_cached"] = (
        row["axis"]["temp_bytes"] / row["cached"]["temp_bytes"]
    )
    print(
        f"clip B={batch_size} N={num}: all_gather form / cached: temporaries "
        f"{row['axis_temp_over_cached']:.3f}x, time "
        f"{spread(paired)['median']:.3f}x (median of rounds); results differ "
        f"by {agree:.2g}"
    )
    return row


def conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(
        x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def cnn_params(channels: tuple, key: jax.Array) -> dict:
    keys = iter(jax.random.split(key, 4 * len(channels) + 4))
    stages, previous = [], 3
    for width in channels:
        stages.append(
            [
                jax.random.normal(next(keys), (3, 3, previous, width))
                / np.sqrt(9 * previous),
                jax.random.normal(next(keys), (3, 3, width, width))
                / np.sqrt(9 * width),
            ]
        )
        previous = width
    head = [
        jax.random.normal(next(keys), (previous, 128)) / np.sqrt(previous),
        jax.random.normal(next(keys), (128, 10)) / np.sqrt(128),
    ]
    return {"stages": stages, "head": head}


def cnn_loss(everywhere: bool, window: bool) -> Callable:
    """Three residual stages of two 3x3 convolutions (a BatchNorm after each
    with ``everywhere``), average-pooled between stages; a projection head
    with a BatchNorm over its hidden layer; cross-entropy on 10 classes."""

    def loss(params: dict, batch: dict) -> jax.Array:
        x = batch["image"]
        for first, second in params["stages"]:
            x = conv(x, first)
            x = jax.nn.relu(batchnorm(x, window, (0, 1, 2)) if everywhere else x)
            y = conv(x, second)
            y = batchnorm(y, window, (0, 1, 2)) if everywhere else y
            x = jax.nn.relu(x + y)
            x = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        pooled = jnp.mean(x, axis=(1, 2))
        hidden = jax.nn.relu(batchnorm(pooled @ params["head"][0], window))
        logits = hidden @ params["head"][1]
        labels = jax.nn.one_hot(batch["label"], 10)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    return loss


def cnn_rows(channels: tuple, batch_size: int, side: int, num: int, rounds: int):
    params = cnn_params(channels, jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 2)
    batch = {
        "image": jax.random.normal(keys[0], (batch_size, side, side, 3)),
        "label": jax.random.randint(keys[1], (batch_size,), 0, 10),
    }
    args = (params, batch)
    rows = []
    for everywhere in (True, False):
        contenders = {
            "full": jax.value_and_grad(cnn_loss(everywhere, False)),
            "plain": jaxaccum.value_and_grad(cnn_loss(everywhere, False), num),
            "axis": jaxaccum.value_and_grad(
                cnn_loss(everywhere, True), num, axis_name=AXIS
            ),
        }
        unrolled = {
            "plain": jaxaccum.value_and_grad(
                cnn_loss(everywhere, False), num, unroll=True
            ),
            "axis": jaxaccum.value_and_grad(
                cnn_loss(everywhere, True), num, axis_name=AXIS, unroll=True
            ),
        }
        compiled = {n: jax.jit(f).lower(*args).compile() for n, f in contenders.items()}
        times = interleaved_seconds(compiled, args, rounds)
        paired = [a / p for a, p in zip(times["axis"], times["plain"], strict=True)]
        row: dict = {"batchnorm": "every convolution" if everywhere else "head only"}
        for name in contenders:
            row[name] = {
                "seconds": spread(times[name]),
                "temp_bytes": compiled[name].memory_analysis().temp_size_in_bytes,
            }
        for name, fun in unrolled.items():
            row[name]["flops"] = counted(fun, *args)
        row["axis_over_plain"] = {
            "flops": row["axis"]["flops"] / row["plain"]["flops"],
            "temp_bytes": row["axis"]["temp_bytes"] / row["plain"]["temp_bytes"],
            "seconds": spread(paired)["median"],
        }
        row["axis_temp_over_full"] = (
            row["axis"]["temp_bytes"] / row["full"]["temp_bytes"]
        )
        for name in ("plain", "axis"):  # against the full batch, round by round
            over = [a / f for a, f in zip(times[name], times["full"], strict=True)]
            row[f"{name}_over_full_seconds_per_round"] = spread(over)
        rows.append(row)
        ratio = row["axis_over_plain"]
        print(
            f"cnn BatchNorm {row['batchnorm']}: axis / micro-batch statistics: "
            f"FLOPs {ratio['flops']:.3f}x, temporaries {ratio['temp_bytes']:.2f}x, "
            f"time {ratio['seconds']:.2f}x; axis temporaries "
            f"{row['axis_temp_over_full']:.3f}x the full batch's"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="small, 2 rounds, no file")
    args = parser.parse_args()
    if args.quick:
        mlp = mlp_rows(width=64, batch_size=256, num=4, blocks=8)
        clip = clip_row(hidden=64, batch_size=256, num=4, rounds=2)
        cnn = cnn_rows((8, 16, 16), batch_size=32, side=8, num=4, rounds=2)
        return
    mlp = mlp_rows(width=512, batch_size=4096, num=16, blocks=8)
    clip = clip_row(hidden=512, batch_size=2048, num=16, rounds=args.rounds)
    cnn = cnn_rows((16, 32, 64), batch_size=256, side=16, num=8, rounds=args.rounds)
    path = write_json(
        "axis",
        {"bounds": BOUNDS, "mlp": mlp, "clip": clip, "cnn": cnn, "rounds": args.rounds},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
