"""The tasks and the optimizer of the growth benchmarks' cost sweep
(growth_cost.py) and its follow-up (growth_adam_noise.py): a teacher-labelled
MLP classifier and a character language model on Python's own source, Adam
with its learning rate following the window's batch.

Nothing is computed at import: the data (the teacher, the held-out batches,
the text) is built on first use and kept.
"""

import functools
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum.growth

# Micro-batches, windows and seeds of the sweep.
MICROBATCH = 32
FIXED_NUM_MICROBATCHES = (2, 4, 8, 16, 32)
BASE_BATCH = FIXED_NUM_MICROBATCHES[0] * MICROBATCH
# Seed 0 chose the targets; seeds 0-2 chose the controller's settings (the
# start rule, the evidence band) and the ramp's horizon; seeds 11-15, never run
# while choosing, are the evaluation.
TUNING_SEEDS = (0, 1, 2)
COST_SEEDS = tuple(range(11, 16))
ADAM_B2, ADAM_EPS = 0.999, 1e-8  # optax's defaults, named: the preconditioner's

# The MLP classifier: Gaussian inputs labelled by a random linear teacher.
FEATURES, HIDDEN, CLASSES = 32, 128, 10
ADAM_LEARNING_RATE = 1e-3  # at the base batch, the smallest fixed window
TARGET_LOSS = 0.15  # held-out cross-entropy; from the pilot, seed 0
MAX_EXAMPLES = 400_000  # a run that has not reached the target stops here
EVAL_SIZE = 1024

# The character language model.
TEXT_FILES = ("argparse.py", "difflib.py", "inspect.py", "typing.py", "tarfile.py")
CONTEXT, EMBED, LM_HIDDEN, VOCAB = 16, 16, 256, 96
LM_TARGET_LOSS = 1.9  # held-out cross-entropy (nats); from the pilot, seed 0
LM_MAX_EXAMPLES = 400_000
LM_LEARNING_RATE = 2e-3
# The ramps decay over what the smallest fixed window needs to reach the
# target on the tuning seeds: the budget a fixed-batch baseline would be given.
MLP_RAMP_EXAMPLES, LM_RAMP_EXAMPLES = 140_000, 70_000


class Task(NamedTuple):
    """A training task for the cost sweep: Adam, the "sqrt" rule, masked."""

    name: str
    loss: Any
    init_params: Any  # key -> params
    make_batch: Any  # (key, rows) -> batch
    eval_batch: Any
    target_loss: float
    max_examples: int
    learning_rate: float
    ramp_examples: int  # the horizon of the ramp's cosine decay


def sweep_optimizer(learning_rate: Any, rule: str) -> optax.GradientTransformation:
    """Every run's optimizer: Adam, its learning rate following the window's
    batch by ``rule`` from BASE_BATCH."""
    return optax.chain(
        optax.scale_by_adam(b2=ADAM_B2, eps=ADAM_EPS),
        jaxaccum.growth.scale_by_batch_learning_rate(learning_rate, BASE_BATCH, rule),
    )


# The MLP classifier -----------------------------------------------------------


@functools.cache
def classifier_teacher() -> jax.Array:
    with jax.ensure_compile_time_eval():  # a constant, even if first asked in jit
        return jax.random.normal(jax.random.key(42), (FEATURES, CLASSES))


def classifier_params(key, sizes=(FEATURES, HIDDEN, HIDDEN, CLASSES)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def classifier_loss(params, batch):
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def classifier_batch(key, size):
    x = jax.random.normal(key, (size, FEATURES))
    return {"x": x, "y": jnp.argmax(x @ classifier_teacher(), axis=-1)}


@functools.cache
def classifier_eval_batch() -> dict:
    with jax.ensure_compile_time_eval():
        return classifier_batch(jax.random.key(999), EVAL_SIZE)


def mlp_cost_task() -> Task:
    return Task(
        "mlp classifier",
        classifier_loss,
        classifier_params,
        classifier_batch,
        classifier_eval_batch(),
        TARGET_LOSS,
        MAX_EXAMPLES,
        ADAM_LEARNING_RATE,
        MLP_RAMP_EXAMPLES,
    )


# The character language model -------------------------------------------------


@functools.cache
def stdlib_text() -> np.ndarray:
    """Python's own standard library source, as byte ids 0..95 (printable
    ASCII and newline; anything else is 95): real text, installed with
    Python."""
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((root / name).read_bytes() for name in TEXT_FILES)
    codes = np.frombuffer(data, np.uint8).astype(np.int32)
    ids = np.where(codes == 10, 0, codes - 31)
    return np.where((ids >= 0) & (ids < 95), ids, 95).astype(np.int32)


def text_split() -> tuple[jax.Array, jax.Array]:
    """The text's first 90% (training) and the rest (held out)."""
    text = stdlib_text()
    return jnp.asarray(text[: int(0.9 * text.size)]), jnp.asarray(
        text[int(0.9 * text.size) :]
    )


def text_batch(text: jax.Array, key: jax.Array, rows: int) -> dict:
    starts = jax.random.randint(key, (rows,), 0, text.size - CONTEXT - 1)
    window = starts[:, None] + jnp.arange(CONTEXT + 1)
    tokens = text[window]
    return {"x": tokens[:, :CONTEXT], "y": tokens[:, CONTEXT]}


def lm_params(key: jax.Array) -> dict:
    embed_key, hidden_key, out_key = jax.random.split(key, 3)
    width = CONTEXT * EMBED
    return {
        "embed": jax.random.normal(embed_key, (VOCAB, EMBED)),
        "hidden": jax.random.normal(hidden_key, (width, LM_HIDDEN)) / np.sqrt(width),
        "hidden_bias": jnp.zeros(LM_HIDDEN),
        "out": jax.random.normal(out_key, (LM_HIDDEN, VOCAB)) / np.sqrt(LM_HIDDEN),
        "out_bias": jnp.zeros(VOCAB),
    }


def lm_loss(params: dict, batch: dict) -> jax.Array:
    """Next character from the 16 before: embeddings, one hidden layer."""
    x = params["embed"][batch["x"]].reshape(batch["x"].shape[0], -1)
    hidden = jax.nn.relu(x @ params["hidden"] + params["hidden_bias"])
    logits = hidden @ params["out"] + params["out_bias"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def lm_cost_task() -> Task:
    train_text, held_out_text = text_split()
    return Task(
        "character language model",
        lm_loss,
        lm_params,
        functools.partial(text_batch, train_text),
        text_batch(held_out_text, jax.random.key(999), 2048),
        LM_TARGET_LOSS,
        LM_MAX_EXAMPLES,
        LM_LEARNING_RATE,
        LM_RAMP_EXAMPLES,
    )
