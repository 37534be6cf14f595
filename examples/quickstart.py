"""Quickstart: one jit-compiled optimizer step = N micro-batches, exactly.

Trains an MLP classifier on synthetic data with an effective batch of 1024
split into 8 micro-batches of 128, after proving that the accumulated gradient
equals the full-batch gradient.
"""

import jax
import jax.numpy as jnp
import optax

import jaxaccum

BATCH_SIZE, NUM_MICROBATCHES, STEPS = 1024, 8, 50


def init(key, sizes=(16, 64, 64, 4)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, batch):
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def make_batch(key, teacher):
    x = jax.random.normal(key, (BATCH_SIZE, 16))
    return {"x": x, "y": jnp.argmax(x @ teacher, axis=-1)}


def main():
    params = init(jax.random.key(0))
    teacher = jax.random.normal(jax.random.key(1), (16, 4))
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)

    batch = make_batch(jax.random.key(2), teacher)
    jaxaccum.testing.assert_grads_match_full_batch(
        loss_fn, params, batch, num_microbatches=NUM_MICROBATCHES, rtol=1e-5, atol=1e-6
    )
    print(
        f"accumulated gradient over {NUM_MICROBATCHES} micro-batches of "
        f"{BATCH_SIZE // NUM_MICROBATCHES} equals the batch-{BATCH_SIZE} gradient "
        "(rtol=1e-5, atol=1e-6)"
    )

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jaxaccum.value_and_grad(loss_fn, NUM_MICROBATCHES)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for step in range(STEPS):
        batch = make_batch(jax.random.fold_in(jax.random.key(3), step), teacher)
        params, opt_state, loss = train_step(params, opt_state, batch)
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
