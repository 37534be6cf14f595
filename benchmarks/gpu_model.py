"""The decoder of ``benchmarks/gpu.py``: a GPT-2-small-like language model in
plain JAX, its layers stacked and run with ``lax.scan`` (as MaxText, Levanter
and praxis do) or as a Python loop over the same stacked parameters.

float32 parameters, bfloat16 compute, pre-norm blocks (RMS norm, causal
``jax.nn.dot_product_attention`` with XLA's implementation, a 4x GELU MLP),
learned positions and an embedding tied to the output layer; the loss is the
mean next-token cross-entropy (float32 log-softmax).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

COMPUTE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Config:
    """A decoder's shape and its batch.

    Attributes:
      vocab: vocabulary size (the tied embedding's rows).
      d_model: width; ``heads`` must divide it.
      heads: attention heads.
      layers: decoder blocks, stacked on one leading axis.
      seq: tokens per sequence.
      batch: sequences per optimizer step (the window's batch).
      scan_layers: run the blocks with ``lax.scan`` (else a Python loop).
    """

    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    scan_layers: bool = True

    def num_params(self) -> int:
        block = 12 * self.d_model**2 + 2 * self.d_model
        return self.layers * block + (self.vocab + self.seq + 1) * self.d_model

    def flops_per_token(self) -> float:
        """Model FLOPs of one token's forward and backward pass (training).

        6 per weight of every matrix product (the tied unembedding counted,
        the embedding lookup not), plus attention's scores and weighted sum,
        ``12 * layers * seq * d_model`` (the causal mask's skipped half
        counted, as PaLM's MFU does).
        """
        matmul_weights = self.layers * 12 * self.d_model**2 + self.vocab * self.d_model
        return 6.0 * matmul_weights + 12.0 * self.layers * self.seq * self.d_model


def init(key: jax.Array, cfg: Config) -> dict:
    """The parameters, float32, GPT-2's initialisation."""
    d, depth = cfg.d_model, cfg.layers
    keys = jax.random.split(key, 6)
    out_scale = 0.02 / math.sqrt(2 * depth)

    def normal(k, shape, scale):
        return scale * jax.random.normal(k, shape, jnp.float32)

    return {
        "embed": normal(keys[0], (cfg.vocab, d), 0.02),
        "pos": normal(keys[1], (cfg.seq, d), 0.01),
        "norm": jnp.ones((d,), jnp.float32),
        "blocks": {
            "norm1": jnp.ones((depth, d), jnp.float32),
            "norm2": jnp.ones((depth, d), jnp.float32),
            "qkv": normal(keys[2], (depth, d, 3 * d), 0.02),
            "proj": normal(keys[3], (depth, d, d), out_scale),
            "up": normal(keys[4], (depth, d, 4 * d), 0.02),
            "down": normal(keys[5], (depth, 4 * d, d), out_scale),
        },
    }


def make_batch(key: jax.Array, cfg: Config, batch_size: int | None = None) -> dict:
    """Random token ids and their next-token targets, int32 ``(B, seq)``."""
    rows = cfg.batch if batch_size is None else batch_size
    tokens = jax.random.randint(key, (rows, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale).astype(COMPUTE)


def _block(cfg: Config, x: jax.Array, p: dict) -> jax.Array:
    rows, seq, d = x.shape
    head = d // cfg.heads
    qkv = _rms_norm(x, p["norm1"]) @ p["qkv"].astype(COMPUTE)
    q, k, v = jnp.split(qkv.reshape(rows, seq, 3 * cfg.heads, head), 3, axis=2)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + attended.reshape(rows, seq, d) @ p["proj"].astype(COMPUTE)
    hidden = jax.nn.gelu(_rms_norm(x, p["norm2"]) @ p["up"].astype(COMPUTE))
    return x + hidden @ p["down"].astype(COMPUTE)


def loss(params: dict, batch: dict, cfg: Config) -> jax.Array:
    """Mean next-token cross-entropy over the batch's tokens."""
    x = (params["embed"][batch["tokens"]] + params["pos"]).astype(COMPUTE)
    blocks = params["blocks"]
    if cfg.scan_layers:
        x, _ = lax.scan(lambda h, p: (_block(cfg, h, p), None), x, blocks)
    else:
        for i in range(cfg.layers):
            x = _block(cfg, x, jax.tree.map(lambda leaf, i=i: leaf[i], blocks))
    logits = _rms_norm(x, params["norm"]) @ params["embed"].T.astype(COMPUTE)
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]
        )
    )
