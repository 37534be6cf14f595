"""A population whose gradient noise is known exactly, for the noise scale tests.

On a linear-regression population whose per-example gradients are known
exactly (vmap over every example), batches are drawn with replacement, so
per-example gradients are i.i.d. with the population's mean G and covariance
Sigma. The mean over M windows of each estimate must be within 5 standard
errors (its sample standard deviation / sqrt(M)) of the truth: a wrong batch
size in an estimator biases it by far more than that (a 25% error in b is
~20 standard errors at M = 1500).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum

POPULATION, FEATURES = 512, 6
WINDOWS = 1500
STANDARD_ERRORS = 5.0


def population():
    kx, kw, kn = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (POPULATION, FEATURES))
    y = x @ jax.random.normal(kw, (FEATURES,)) + 0.5 * jax.random.normal(
        kn, (POPULATION,)
    )
    return x, y


def per_example_loss(w, x, y):
    return 0.5 * (x @ w - y) ** 2


def mean_loss(w, x, y):
    return jnp.mean(per_example_loss(w, x, y))


def weighted_loss(w, x, y, mask):
    return jaxaccum.masked_sum(per_example_loss(w, x, y), mask)


def truth(w, x, y):
    """|G|^2 and tr(Sigma) of the per-example gradients of the population."""
    grads = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0, 0))(w, x, y)
    mean = grads.mean(axis=0)
    return float(mean @ mean), float(jnp.sum(grads.var(axis=0)))


def assert_unbiased(estimates, expected, name):
    estimates = np.asarray(estimates, np.float64)
    standard_error = estimates.std() / np.sqrt(estimates.size)
    error = abs(estimates.mean() - expected)
    assert error < STANDARD_ERRORS * standard_error, (
        f"{name}: mean estimate {estimates.mean():.5g} vs truth {expected:.5g}, "
        f"off by {error / standard_error:.1f} standard errors "
        f"({standard_error:.3g}) over {estimates.size} windows"
    )


def sample(key, x, y, batch_size, reduction):
    """A batch drawn with replacement: ``(x, y)``, and for "weighted" a mask
    that keeps each example with probability 0.6 (varying weights)."""
    rows_key, mask_key = jax.random.split(key)
    rows = jax.random.randint(rows_key, (batch_size,), 0, POPULATION)
    batch = (x[rows], y[rows])
    if reduction == "weighted":
        batch += (jax.random.bernoulli(mask_key, 0.6, (batch_size,)),)
    return batch


def loss_for(reduction):
    """The loss and its accumulation options for a reduction."""
    if reduction == "mean":
        return mean_loss, {"batch_argnums": (1, 2)}
    return weighted_loss, {"batch_argnums": (1, 2, 3), "reduction": "weighted"}
