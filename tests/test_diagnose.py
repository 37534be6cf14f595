"""jaxaccum.testing.diagnose names why accumulation differs from the full batch.

Tolerances (float32): a model "matches" at diagnose's defaults (rtol=1e-5,
atol=1e-6, about 170 and 17 float32 unit roundoffs: the tests' sums have at
most 64 terms, see tests/tolerances.py). The figures the diagnosis infers
(scale, weights) are ratios of float32 norms, exact up to that rounding;
rtol=1e-3 only has to tell them from the next plausible value (1/N from 1).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import classification_batch, mlp_apply, mlp_loss, mlp_params

import jaxaccum
import jaxaccum.flax
from jaxaccum.testing import Diagnosis, diagnose

BATCH_SIZE = 16


@pytest.fixture(scope="module")
def mlp():
    return mlp_params(jax.random.key(0)), classification_batch(
        jax.random.key(1), BATCH_SIZE
    )


class NormMLP(nn.Module):
    """Dense -> (BatchNorm | LayerNorm) -> Dense."""

    norm: str

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        if self.norm == "batch":
            x = nn.BatchNorm(use_running_average=False)(x)
        else:
            x = nn.LayerNorm()(x)
        return nn.Dense(3)(nn.relu(x))


def linen_loss(model):
    def loss(variables, batch):
        logits, updates = model.apply(variables, batch["x"], mutable=["batch_stats"])
        labels = batch["y"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.mean(loss), updates

    return loss


def kinds(diagnosis: Diagnosis) -> list[str]:
    return [cause.kind for cause in diagnosis.causes]


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_names_batchnorm(mlp, num_microbatches):
    _, batch = mlp
    model = NormMLP("batch")
    variables = model.init(jax.random.key(2), batch["x"])
    diagnosis = jaxaccum.flax.linen_diagnose(
        linen_loss(model),
        variables,
        batch,
        num_microbatches=num_microbatches,
        mutable="batch_stats",
    )
    report = str(diagnosis)
    assert not diagnosis.matches
    assert kinds(diagnosis) == ["batch_dependent"], report
    assert "BatchNorm" in diagnosis.causes[0].message
    assert "['batch_stats']['BatchNorm_0']['mean']" in report  # the state named
    # The exact path for BatchNorm itself: the window as its axis (issue 67).
    message = diagnosis.causes[0].message  # the report wraps its lines
    assert "axis_name=" in message and "flax.md#batchnorm" in message, message
    # Where the examples meet after a per-example encoder, the exact path.
    assert "jaxaccum.cached_value_and_grad is exact" in message, message
    assert "docs/guides/whole-batch.md" in report, report
    assert diagnosis.interaction > 1e-2, report
    # The price of micro-batch statistics, in the failure message if it changes.
    assert diagnosis.relative_error > 0.05, report


def test_names_batchnorm_in_a_plain_function(mlp):
    """testing.diagnose on a pure loss with the statistics as state_argnums."""
    _, batch = mlp
    model = NormMLP("batch")
    variables = model.init(jax.random.key(2), batch["x"])

    def loss(params, batch, batch_stats):
        value, updates = linen_loss(model)(
            {"params": params, "batch_stats": batch_stats}, batch
        )
        return value, updates["batch_stats"]

    diagnosis = diagnose(
        loss,
        variables["params"],
        batch,
        variables["batch_stats"],
        num_microbatches=4,
        state_argnums=2,
    )
    assert kinds(diagnosis) == ["batch_dependent"], str(diagnosis)
    assert "args[2]['BatchNorm_0']['mean']" in diagnosis.causes[0].message


def test_names_batchnorm_in_an_nnx_model(mlp):
    _, batch = mlp
    model = nnx.Sequential(
        nnx.Linear(6, 8, rngs=nnx.Rngs(0)),
        nnx.BatchNorm(8, rngs=nnx.Rngs(0)),
        nnx.Linear(8, 3, rngs=nnx.Rngs(0)),
    )
    before = nnx.state(model)

    def loss(model, batch):
        logits = model(batch["x"])
        labels = batch["y"]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    diagnosis = jaxaccum.flax.nnx_diagnose(loss, model, batch, num_microbatches=2)
    assert kinds(diagnosis) == ["batch_dependent"], str(diagnosis)
    chex.assert_trees_all_equal(nnx.state(model), before)  # model left as it was


def test_layernorm_model_matches(mlp):
    _, batch = mlp
    num_microbatches = 4
    model = NormMLP("layer")
    variables = model.init(jax.random.key(2), batch["x"])

    def loss(variables, batch):
        logits = model.apply(variables, batch["x"])
        labels = batch["y"]
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    diagnosis = jaxaccum.flax.linen_diagnose(
        loss, variables, batch, num_microbatches=num_microbatches
    )
    report = str(diagnosis)
    assert diagnosis.matches, report
    assert diagnosis.causes == ()
    assert f"N={num_microbatches} micro-batches match the full batch" in report
    assert diagnosis.relative_error < 1e-5, report
    paths = [error.path for error in diagnosis.leaf_errors]
    assert "['grads']['Dense_0']['kernel']" in paths
    assert "['value']" in paths


def test_names_sum_where_a_mean_was_expected(mlp):
    params, batch = mlp
    num_microbatches = 4

    def summed(params, batch):
        return mlp_loss(params, batch) * batch["y"].shape[0]

    diagnosis = diagnose(summed, params, batch, num_microbatches=num_microbatches)
    assert kinds(diagnosis) == ["loss_scale"], str(diagnosis)
    np.testing.assert_allclose(diagnosis.gradient_scale, 1 / num_microbatches, 1e-3)
    message = diagnosis.causes[0].message
    assert f"1/N times (N={num_microbatches})" in message
    assert "reduction='sum'" in message


def test_names_mean_where_a_sum_was_expected(mlp):
    params, batch = mlp
    num_microbatches = 2
    diagnosis = diagnose(
        mlp_loss, params, batch, num_microbatches=num_microbatches, reduction="sum"
    )
    assert kinds(diagnosis) == ["loss_scale"], str(diagnosis)
    np.testing.assert_allclose(diagnosis.gradient_scale, num_microbatches, 1e-3)
    message = diagnosis.causes[0].message
    assert f"N times (N={num_microbatches})" in message
    assert "reduction='mean'" in message


def test_names_other_batch_size_normalization(mlp):
    params, batch = mlp

    def root_normalized(params, batch):
        return mlp_loss(params, batch) * jnp.sqrt(batch["y"].shape[0])

    diagnosis = diagnose(root_normalized, params, batch, num_microbatches=4)
    assert kinds(diagnosis) == ["loss_scale"], str(diagnosis)
    np.testing.assert_allclose(diagnosis.gradient_scale, 0.5, 1e-3)  # 1/sqrt(4)
    assert "normalizes its loss by a function" in diagnosis.causes[0].message


def masked_batch(mlp):
    """Micro-batch k of 4 (rows k, k+4, ...) has k + 1 valid rows."""
    _, batch = mlp
    rows = jnp.arange(BATCH_SIZE)
    return {**batch, "mask": rows // 4 < rows % 4 + 1}


def masked_losses(params, batch):
    logits = mlp_apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def test_names_unequal_weights_and_points_to_weighted(mlp):
    params, _ = mlp
    batch = masked_batch(mlp)

    def masked_mean(params, batch):
        total, count = jaxaccum.masked_sum(masked_losses(params, batch), batch["mask"])
        return total / count

    diagnosis = diagnose(masked_mean, params, batch, num_microbatches=4)
    assert kinds(diagnosis) == ["unequal_weights"], str(diagnosis)
    # Valid rows per micro-batch 1, 2, 3, 4: weights relative to their mean.
    np.testing.assert_allclose(
        diagnosis.microbatch_weights, [0.4, 0.8, 1.2, 1.6], rtol=1e-3
    )
    assert "reduction='weighted'" in diagnosis.causes[0].message

    def masked_sum(params, batch):
        return jaxaccum.masked_sum(masked_losses(params, batch), batch["mask"])

    fixed = diagnose(
        masked_sum, params, batch, num_microbatches=4, reduction="weighted"
    )
    assert fixed.matches, str(fixed)


def test_names_randomness(mlp):
    params, batch = mlp

    def dropout_loss(params, batch, key):
        keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
        return mlp_loss(params, {**batch, "x": jnp.where(keep, batch["x"], 0.0)})

    diagnosis = diagnose(
        dropout_loss,
        params,
        batch,
        jax.random.key(0),
        num_microbatches=2,
        key_argnums=2,
    )
    assert kinds(diagnosis) == ["random"], str(diagnosis)
    assert "deterministic=True" in diagnosis.causes[0].message


def test_report_lists_every_leaf_worst_first(mlp):
    params, batch = mlp

    def summed(params, batch):
        return mlp_loss(params, batch) * batch["y"].shape[0]

    diagnosis = diagnose(summed, params, batch, num_microbatches=2)
    lines = str(diagnosis).splitlines()
    assert lines[0] == (
        "N=2 micro-batches do NOT match the full batch (rtol=1e-05, atol=1e-06)."
    )
    assert lines[1].startswith("Gradient error: 0.5 of")  # 1 - 1/N
    rows = lines[3 : 3 + len(diagnosis.leaf_errors)]
    assert len(diagnosis.leaf_errors) == 1 + 2 * len(params)  # value, w and b
    errors = [float(row.split()[-2]) for row in rows]
    assert errors == sorted(errors, reverse=True), "\n".join(lines)
    assert lines[3 + len(rows)].startswith("Cause (loss_scale):")  # after the table
