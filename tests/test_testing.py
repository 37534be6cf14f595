"""jaxaccum.testing: the equivalence assertion passes and fails as it should."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from models import classification_batch, mlp_loss, mlp_params
from tolerances import ATOL, RTOL

import jaxaccum
import jaxaccum.testing
from jaxaccum.testing import assert_grads_match_full_batch


def test_passes_on_a_correct_mean_loss():
    params, batch = (
        mlp_params(jax.random.key(0)),
        classification_batch(jax.random.key(1), 16),
    )
    assert_grads_match_full_batch(
        mlp_loss, params, batch, num_microbatches=4, rtol=RTOL, atol=ATOL
    )
    assert_grads_match_full_batch(
        mlp_loss, params, batch, microbatch_size=4, rtol=RTOL, atol=ATOL
    )


def test_failure_names_leaf_error_and_n():
    """A loss that scales with its batch size breaks exactness: it is caught."""
    params = {"w": jnp.ones(3)}
    batch = jax.random.normal(jax.random.key(0), (8, 3))

    def size_dependent(params, x):
        return jnp.sum(x @ params["w"]) / jnp.sqrt(x.shape[0])

    with pytest.raises(AssertionError) as info:
        assert_grads_match_full_batch(size_dependent, params, batch, num_microbatches=4)
    message = str(info.value)
    assert "num_microbatches=4" in message
    assert "['grads']['w']: max abs error" in message
    assert "relative error 0.5" in message  # sqrt(8)/sqrt(2) / sqrt(8) = 0.5 off
    assert "['value']" in message


def test_failure_with_microbatch_size_and_aux():
    def summed(params, x):
        return jnp.sum(x @ params), {"n": x.shape[0]}

    with pytest.raises(AssertionError, match="microbatch_size=2"):
        assert_grads_match_full_batch(
            summed, jnp.ones(3), jnp.ones((8, 3)), microbatch_size=2, has_aux=True
        )


def test_accepts_report_finite_and_state():
    def loss(w, x, state):
        return jnp.mean(jnp.tanh(x @ w)), state + 1

    assert_grads_match_full_batch(
        loss,
        jnp.ones(3),
        jnp.ones((8, 3)),
        jnp.zeros(()),
        num_microbatches=4,
        state_argnums=2,
        report_finite=True,
        rtol=RTOL,
        atol=ATOL,
    )


def test_window_bytes_counts_each_loop_by_its_trip_count():
    """window_bytes took num_microbatches for every loop: a scan unrolled by
    2 runs N / 2 iterations of a body holding two copies (counted 2N times),
    a pipeline runs M R + S - 1 ticks (issue 45, case 5). It reads each
    loop's trip count from the HLO; the 8-device pipeline checks compare it
    with the ticks."""
    from jaxaccum._plan._hlo import _computations, _runs

    text = (
        "HloModule m\n\n"
        "%body.1 (p: (s32[])) -> (s32[]) {\n"
        "  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), "
        "source_target_pairs={{0,1}}\n"
        "}\n\n"
        "%inner (p: (s32[])) -> (s32[]) {\n"
        "  %ar = f32[2]{0} all-reduce(f32[2]{0} %y), replica_groups={{0,1}}\n"
        "}\n\n"
        "%body.2 (p: (s32[])) -> (s32[]) {\n"
        "  %w2 = (s32[]) while((s32[]) %p), condition=%c, body=%inner, "
        'backend_config={"known_trip_count":{"n":"3"}}\n'
        "}\n\n"
        "ENTRY %main () -> f32[] {\n"
        "  %w = (s32[]) while((s32[]) %i), condition=%c, body=%body.1, "
        'backend_config={"known_trip_count":{"n":"7"}}\n'
        "  %v = (s32[]) while((s32[]) %i), condition=%c, body=%body.2, "
        'backend_config={"known_trip_count":{"n":"5"}}\n'
        "  %ag = f32[8]{0} all-gather(f32[4]{0} %z), replica_groups={{0,1}}\n"
        "}\n"
    )
    runs = _runs(_computations(text))
    assert (runs("body.1"), runs("inner"), runs("main")) == (7, 15, 1)
    assert jaxaccum.testing.window_bytes(text) == 7 * 16 + 15 * 8 + 32
    unknown = text.replace('backend_config={"known_trip_count":{"n":"7"}}', "")
    with pytest.raises(ValueError, match="pass num_microbatches="):
        jaxaccum.testing.window_bytes(unknown)
    assert jaxaccum.testing.window_bytes(unknown, 4) == 4 * 16 + 15 * 8 + 32


def _tanh_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w))


def _tanh_sum(w, x):
    return jnp.sum(jnp.tanh(x @ w))  # a sum, wrong under reduction="mean"


def _checks():
    """Each checker as ``check(loss, w, x, **keywords) -> matches``."""
    import equinox  # noqa: F401  (the Equinox checks need it)
    from flax import nnx

    import jaxaccum.equinox
    import jaxaccum.flax

    def asserted(check):
        def run(loss, w, x, **keywords):
            try:
                check(loss, w, x, **keywords)
            except AssertionError:
                return False
            return True

        return run

    def linen(loss, w, x, **keywords):
        def on_variables(variables, x):
            return loss(variables["params"]["w"], x)

        return jaxaccum.flax.linen_diagnose(
            on_variables, {"params": {"w": w}}, x, **keywords
        ).matches

    class Model(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)

    def flax_nnx(loss, w, x, **keywords):
        return jaxaccum.flax.nnx_diagnose(
            lambda model, x: loss(model.w[...], x), Model(w), x, **keywords
        ).matches

    return {
        "assert_grads_match_full_batch": asserted(assert_grads_match_full_batch),
        "diagnose": lambda *a, **k: jaxaccum.testing.diagnose(*a, **k).matches,
        "filter_assert_grads_match_full_batch": asserted(
            jaxaccum.equinox.filter_assert_grads_match_full_batch
        ),
        "filter_diagnose": lambda *a, **k: (
            jaxaccum.equinox.filter_diagnose(*a, **k).matches
        ),
        "linen_diagnose": linen,
        "nnx_diagnose": flax_nnx,
    }


@pytest.mark.parametrize("option", ["masked", "report_stats"])
@pytest.mark.parametrize("checker", sorted(_checks()))
def test_checkers_take_masked_and_report_options(checker, option):
    """``masked=True`` compares a masked window with every micro-batch active
    (``active_microbatches=N``) with the big batch, and ``report_stats``
    leaves the comparison as it is: a right loss matches, a wrong one does
    not (a sum under ``reduction="mean"``: N times the gradient)."""
    check = _checks()[checker]
    w = jnp.linspace(-1.0, 1.0, 3)
    x = jax.random.normal(jax.random.key(0), (8, 3))
    keywords = {"num_microbatches": 4, option: True, "rtol": RTOL, "atol": ATOL}
    assert check(_tanh_loss, w, x, **keywords), f"{checker}({option}=True)"
    assert not check(_tanh_sum, w, x, **keywords), f"{checker}({option}=True)"


# The window as a named axis (issue 72, item 10). The claim: the window is
# the full batch as the axis's one member, the same sums in another order;
# in float64 that is within 1e-12 (float64 rounding, 2**-53 per operation
# over sums of at most 16 terms, is below 1e-14; tests/test_axis.py).
AXIS = "window"
FLOAT64_TOL = 1e-12


def _standardized(h, axis_name, pooled_variance=False):
    """BatchNorm's normalization of ``h`` over its batch: by the window's
    mean and variance where ``axis_name`` is given (each a ``lax.pmean`` of
    the micro-batch's), by the micro-batch's without. ``pooled_variance``:
    the ``lax.pmean`` of the micro-batches' own variances instead, which
    misses the variance of their means (law of total variance)."""
    mean = jnp.mean(h, 0)
    if axis_name is None:
        return (h - mean) / jnp.sqrt(jnp.var(h, 0) + 1e-5)
    mean = lax.pmean(mean, axis_name)
    if pooled_variance:
        variance = lax.pmean(jnp.var(h, 0), axis_name)
    else:
        variance = lax.pmean(jnp.mean((h - mean) ** 2, 0), axis_name)
    return (h - mean) / jnp.sqrt(variance + 1e-5)


def _batchnorm_loss(axis_name=AXIS, pooled_variance=False):
    def loss(w, x):
        y = _standardized(x @ w, axis_name, pooled_variance)
        return jnp.mean(jnp.tanh(y) ** 2 + y[:, :1])

    return loss


class _LinenBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False, axis_name=AXIS)(nn.Dense(4)(x))
        return nn.Dense(1)(nn.tanh(h))[:, 0]


def _linen_problem(x):
    """A Linen BatchNorm over the window, its running averages carried as
    state (argument 2)."""
    model = _LinenBatchNorm()
    variables = model.init(jax.random.key(2), x)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables)

    def loss(params, x, batch_stats):
        out, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean((out - x[:, 0]) ** 2), updates["batch_stats"]

    return loss, variables["params"], variables["batch_stats"]


def _in_batch_negatives(w, x):
    """Contrastive: each row against the whole window's embeddings, its
    positive (itself) found by ``axis_index``."""
    embeddings = jnp.tanh(x @ w)
    others = lax.all_gather(embeddings, AXIS, tiled=True)
    rows = embeddings.shape[0]
    labels = lax.axis_index(AXIS) * rows + jnp.arange(rows)
    log_probs = jax.nn.log_softmax(embeddings @ others.T)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def _dropout_loss(w, x, key):
    """The window's BatchNorm behind a dropout mask drawn from ``key``."""
    kept = jax.random.bernoulli(key, 0.5, x.shape)
    return _batchnorm_loss()(w, jnp.where(kept, 2 * x, 0))


def _axis_problem(name):
    """``(loss, args, keywords)`` of a float64 loss with collectives over
    the window: 16 examples of 3 features."""
    x = jax.random.normal(jax.random.key(1), (16, 3), jnp.float64)
    w = jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)
    if name == "linen_batchnorm":
        loss, params, stats = _linen_problem(x)
        return loss, (params, x, stats), {"state_argnums": 2}
    if name == "dropout":
        return _dropout_loss, (w, x, jax.random.key(3)), {"key_argnums": 2}
    losses = {
        "batchnorm": _batchnorm_loss(),
        "micro_batch_statistics": _batchnorm_loss(axis_name=None),
        "in_batch_negatives": _in_batch_negatives,
        "pooled_variance": _batchnorm_loss(pooled_variance=True),
    }
    return losses[name], (w, x), {}


@pytest.mark.parametrize("name", ["batchnorm", "linen_batchnorm", "in_batch_negatives"])
def test_checks_a_loss_with_collectives_over_the_window(name):
    """With ``axis_name``, a loss whose coupling is all collectives over the
    window matches the full batch as the axis's one member (float64, 1e-12):
    the assertion passes and ``diagnose`` finds no cause."""
    with jax.enable_x64():
        loss, args, keywords = _axis_problem(name)
        keywords |= {"num_microbatches": 4, "axis_name": AXIS}
        tolerances = {"rtol": FLOAT64_TOL, "atol": FLOAT64_TOL}
        assert_grads_match_full_batch(loss, *args, **keywords, **tolerances)
        diagnosis = jaxaccum.testing.diagnose(loss, *args, **keywords, **tolerances)
    assert diagnosis.matches and diagnosis.causes == (), str(diagnosis)


def test_a_window_not_the_big_batchs_fails_with_the_axis():
    """The pmean of the micro-batches' variances is not the batch's variance
    (it misses the variance of their means): the assertion fails, by far more
    than rounding."""
    with jax.enable_x64():
        loss, args, _ = _axis_problem("pooled_variance")
        with pytest.raises(AssertionError) as info:
            assert_grads_match_full_batch(
                loss, *args, num_microbatches=4, axis_name=AXIS
            )
    message = str(info.value)
    assert "num_microbatches=4" in message
    assert "['grads']: max abs error" in message, message


@pytest.mark.parametrize(
    ("name", "axis_name", "cause", "advice"),
    [
        # Without the axis, BatchNorm's statistics are the micro-batch's: the
        # advice is the axis.
        ("micro_batch_statistics", None, "batch_dependent", "pass the same axis_name="),
        # With it, the coupling that bypasses it is named.
        ("pooled_variance", AXIS, "batch_dependent", "some coupling bypasses them"),
        # Every probe binds the axis: the key's, here.
        ("dropout", AXIS, "random", "depends on its PRNG key"),
    ],
    ids=["micro_batch_statistics", "pooled_variance", "dropout"],
)
def test_diagnose_with_and_without_the_axis_names_the_cause(
    name, axis_name, cause, advice
):
    with jax.enable_x64():
        loss, args, keywords = _axis_problem(name)
        diagnosis = jaxaccum.testing.diagnose(
            loss, *args, num_microbatches=4, axis_name=axis_name, **keywords
        )
    report = str(diagnosis)
    assert [found.kind for found in diagnosis.causes] == [cause], report
    assert advice in diagnosis.causes[0].message, report
    assert diagnosis.relative_error > 1e-2, report  # far beyond rounding


@pytest.mark.parametrize("checker", ["assert_grads_match_full_batch", "diagnose"])
def test_an_unbound_window_axis_says_to_pass_axis_name(checker):
    """A loss with collectives over the window, checked without
    ``axis_name``: JAX's unbound-axis error, with a note naming the keyword."""
    check = getattr(jaxaccum.testing, checker)
    with jax.enable_x64():
        loss, args, _ = _axis_problem("batchnorm")
        with pytest.raises(NameError) as info:
            check(loss, *args, num_microbatches=4)
    assert "pass its name as axis_name=" in "\n".join(info.value.__notes__)
