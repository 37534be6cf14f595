"""Small models and losses shared by the tests (kept tiny so CI stays fast)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def mlp_params(key: jax.Array, sizes=(6, 16, 16, 3), dtype=jnp.float32) -> list:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": (jax.random.normal(k, (a, b)) / jnp.sqrt(a)).astype(dtype),
            "b": jnp.zeros((b,), dtype),
        }
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_apply(params: list, x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params: list, batch: dict) -> jax.Array:
    """Mean cross-entropy over the batch."""
    logits = mlp_apply(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def mlp_loss_with_aux(params: list, batch: dict):
    logits = mlp_apply(params, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
    aux = {
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]),
        "correct": correct,
        "first_loss": losses[0],
    }
    return jnp.mean(losses), aux


def classification_batch(key: jax.Array, batch_size: int, features=6, classes=3):
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (batch_size, features)),
        "y": jax.random.randint(ky, (batch_size,), 0, classes),
    }


class SmallCNN(nn.Module):
    """Conv -> GroupNorm -> Conv -> LayerNorm -> pooled dense: batch-independent."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.GroupNorm(num_groups=4)(x))
        x = nn.Conv(8, (3, 3), strides=2)(x)
        x = nn.relu(nn.LayerNorm()(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


class AttentionBlock(nn.Module):
    """One pre-norm self-attention block with an MLP, mean-pooled to logits."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, h)
        x = x + nn.Dense(8)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))
        return nn.Dense(3)(x.mean(axis=1))


def flax_loss(module: nn.Module):
    def loss(params, batch):
        logits = module.apply({"params": params}, batch["x"])
        return jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        )

    return loss


def token_batch(key: jax.Array, lengths, seq_len: int = 12, vocab: int = 11):
    """Random token sequences, each padded (token 0) after its length."""
    lengths = jnp.asarray(lengths)
    tokens = jax.random.randint(key, (lengths.shape[0], seq_len), 1, vocab)
    valid = jnp.arange(seq_len) < lengths[:, None]
    return {"tokens": jnp.where(valid, tokens, 0), "lengths": lengths}


def next_token_losses(module: nn.Module, params, batch):
    """Per-position next-token losses and the mask of positions that count."""
    tokens = batch["tokens"]
    logits = module.apply({"params": params}, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    mask = jnp.arange(1, tokens.shape[1]) < batch["lengths"][:, None]
    return losses, mask
