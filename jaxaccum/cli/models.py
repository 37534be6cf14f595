"""Small Flax models on synthetic, learnable data: what ``jaxaccum demo`` and
``jaxaccum bench`` train, public so that ``benchmarks/`` (and a user checking
a figure) build the same tasks.

Each ``*_task`` returns a :class:`Task`: the loss, initial parameters and a
function making a batch from a key. Data are generated in-process (no
download) by a fixed random "teacher", so the loss falls when training works.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxaccum._types import Fun, Params


@dataclasses.dataclass(frozen=True)
class Task:
    """A model, its loss and its data.

    Attributes:
      name: a short name for tables.
      loss: ``loss(params, batch) -> scalar``, the mean over the batch.
      params: initial parameters.
      make_batch: ``make_batch(key, batch_size) -> batch``.
    """

    name: str
    loss: Callable[[Any, Any], jax.Array]
    params: Params
    make_batch: Callable[[jax.Array, int], Any]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


class MLP(nn.Module):
    """A ReLU MLP classifier."""

    hidden: tuple[int, ...] = (512, 512)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


def mlp_task(features: int = 784, hidden=(512, 512), classes: int = 10, seed=0):
    """Classify Gaussian inputs labelled by a random linear teacher."""
    model = MLP(tuple(hidden), classes)
    teacher = jax.random.normal(jax.random.key(seed + 1), (features, classes))

    def make_batch(key, batch_size):
        x = jax.random.normal(key, (batch_size, features))
        return {"x": x, "y": jnp.argmax(x @ teacher, axis=-1)}

    def loss(params, batch):
        return _cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"])

    params = model.init(jax.random.key(seed), jnp.zeros((1, features)))["params"]
    return Task(
        f"mlp-{features}-{'-'.join(map(str, hidden))}-{classes}",
        loss,
        params,
        make_batch,
    )


class Transformer(nn.Module):
    """A pre-norm causal transformer language model."""

    vocab: int = 32
    width: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param(
            "positions", nn.initializers.normal(0.02), (tokens.shape[-1], self.width)
        )
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def transformer_task(seq_len: int = 32, vocab: int = 32, width: int = 64, seed=0):
    """Predict the next token of arithmetic sequences (start + step * t) mod vocab."""
    model = Transformer(vocab, width)

    def make_batch(key, batch_size):
        start_key, step_key = jax.random.split(key)
        start = jax.random.randint(start_key, (batch_size, 1), 0, vocab)
        step = jax.random.randint(step_key, (batch_size, 1), 1, 4)
        return {"tokens": (start + step * jnp.arange(seq_len + 1)) % vocab}

    def loss(params, batch):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1])
        return _cross_entropy(logits, tokens[:, 1:])

    params = model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))
    return Task(
        f"transformer-{model.layers}x{width}", loss, params["params"], make_batch
    )


class CNN(nn.Module):
    """Two convolutions with GroupNorm, pooled into a classifier."""

    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for channels in (16, 32):
            x = nn.Conv(channels, (3, 3), strides=2)(x)
            x = nn.relu(nn.GroupNorm(num_groups=4)(x))
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def cnn_task(size: int = 16, classes: int = 10, seed=0):
    """Classify noisy images by which of ``classes`` random templates they hold."""
    model = CNN(classes)
    templates = jax.random.normal(jax.random.key(seed + 1), (classes, size, size, 3))

    def make_batch(key, batch_size):
        label_key, noise_key = jax.random.split(key)
        y = jax.random.randint(label_key, (batch_size,), 0, classes)
        noise = jax.random.normal(noise_key, (batch_size, size, size, 3))
        return {"x": templates[y] + 2.0 * noise, "y": y}

    def loss(params, batch):
        return _cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"])

    params = model.init(jax.random.key(seed), jnp.zeros((1, size, size, 3)))["params"]
    return Task("cnn-16-32", loss, params, make_batch)


@dataclasses.dataclass(frozen=True)
class PipelinedTask:
    """A model split for :func:`jaxaccum.pipeline_value_and_grad`.

    Attributes:
      name: a short name for tables.
      stage_fn: ``stage_fn(stage_params, x) -> x``, one stage.
      loss_fn: ``loss_fn(head_params, x, micro_batch) -> loss``, the mean.
      embed_fn: ``embed_fn(embed_params, micro_batch) -> x``.
      params: ``(embed_params, stage_params, head_params)``, the stages
        stacked on axis 0.
      make_batch: ``make_batch(key, batch_size) -> batch``.
    """

    name: str
    stage_fn: Fun
    loss_fn: Fun
    embed_fn: Fun
    params: tuple
    make_batch: Callable[[jax.Array, int], Any]


def pipelined_mlp_task(
    features: int = 784, width: int = 512, stages: int = 4, classes: int = 10, seed=0
) -> PipelinedTask:
    """:func:`mlp_task`'s data through a deeper MLP cut into ``stages``
    residual ReLU blocks of ``width``: an embedding, the blocks, a head."""
    teacher = jax.random.normal(jax.random.key(seed + 1), (features, classes))
    keys = jax.random.split(jax.random.key(seed), 3)
    params = (
        {"w": jax.random.normal(keys[0], (features, width)) * features**-0.5},
        {
            "w": jax.random.normal(keys[1], (stages, width, width)) * width**-0.5,
            "b": jnp.zeros((stages, width)),
        },
        {"w": jax.random.normal(keys[2], (width, classes)) * width**-0.5},
    )

    def embed_fn(params, batch):
        return batch["x"] @ params["w"]

    def stage_fn(params, x):
        return x + nn.relu(x @ params["w"] + params["b"])

    def loss_fn(params, x, batch):
        return _cross_entropy(x @ params["w"], batch["y"])

    def make_batch(key, batch_size):
        x = jax.random.normal(key, (batch_size, features))
        return {"x": x, "y": jnp.argmax(x @ teacher, axis=-1)}

    name = f"pipelined-mlp-{features}-{stages}x{width}-{classes}"
    return PipelinedTask(name, stage_fn, loss_fn, embed_fn, params, make_batch)
