"""jaxaccum.testing: the equivalence assertion passes and fails as it should."""

import jax
import jax.numpy as jnp
import pytest
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
