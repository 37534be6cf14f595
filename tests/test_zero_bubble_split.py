"""Zero-bubble's stage backward split into B and W (issue 62).

Item 3: with ``remat`` (True or a checkpoint policy) B and W recompute the
stage's forward, and where that holds a ``custom_jvp`` or ``custom_vjp``
call (``jax.nn.softplus``, ``jnp.logaddexp``, ...) the split re-bound it as
a plain primitive (``KeyError: 'subfuns'``). Checked on the split of one
stage in this process (cheap: no mesh, no pipeline), drawn over stage
bodies, and end to end on a mesh of one stage against the sequential model.
Item 2: ``remat=None`` is no remat, in the schedule's tables and the
planner's rows.

Tolerances, all in float64: XLA's fused float32 code for a stage holding
several of these activations is itself off by up to 1e-3 relative against
the same ops run one by one (seen with all seven in one stage, whether a
pipeline schedule, the core or a plain ``jax.jit`` of the model runs it);
its float64 code is not. B and W run the pullback's own equations (the
split re-binds them, in the same order), so the only differences are XLA's
fusion and summation order inside each contraction: ``tests/tolerances.py``'s
bound (two orders of sums of at most ``MAX_TERMS`` terms, unit-scale data)
at float64's unit roundoff. End to end, the pipeline against the sequential
model on the whole batch: pipeline_checks' bound over the gradient's chain.
"""

import functools
import unittest.mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AbstractMesh
from pipeline_checks import (
    BATCH,
    make_batch,
    make_params,
    sequential,
    tolerance,
)
from pipeline_checks import embed_fn as embed
from pipeline_checks import loss_fn as mse
from tolerances import ATOL64, RTOL64

import jaxaccum
from jaxaccum._pipeline._1f1b_tick import backward, forward
from jaxaccum._pipeline._calls import _stage_policy
from jaxaccum._pipeline._plan_result import PipelinePlanRow
from jaxaccum._pipeline._zero_bubble import ZeroBubble
from jaxaccum._pipeline._zero_bubble_split import (
    input_part,
    split_backward,
    weight_part,
)

FEATURES = 8
ROWS = 6
# tests/tolerances.py's float64 bound: two orders of sums of at most
# MAX_TERMS terms, times sum|t_i| <= 1 on unit-scale data (2.8e-14).
SPLIT_RTOL, SPLIT_ATOL = RTOL64, ATOL64


@jax.custom_vjp
def scaled_tanh(h, scale):
    """A user's ``custom_vjp`` function of the activation and a parameter."""
    return jnp.tanh(h) * scale


def _scaled_tanh_forward(h, scale):
    t = jnp.tanh(h)
    return t * scale, (t, scale)


def _scaled_tanh_backward(residuals, g):
    t, scale = residuals
    return g * scale * (1 - t * t), jnp.sum(g * t, axis=0)


scaled_tanh.defvjp(_scaled_tanh_forward, _scaled_tanh_backward)

# The functions, each a custom_jvp call (or holding one).
CUSTOM = {
    "softplus": jax.nn.softplus,
    "logaddexp": lambda h: jnp.logaddexp(h, 0.5 * h),
    "log_sigmoid": jax.nn.log_sigmoid,
    "cumlogsumexp": lambda h: lax.cumlogsumexp(h, axis=1),
    "sinc": jnp.sinc,
    "logaddexp2": lambda h: jnp.logaddexp2(h, -h),
    "mish": jax.nn.mish,
}
# A stage body's layers, ``(params, h) -> h``: the custom ones and plain ones.
LAYERS = {
    **{name: lambda p, h, f=f: f(h) for name, f in CUSTOM.items()},
    "custom_vjp": lambda p, h: scaled_tanh(h, p["s"]),
    "tanh": lambda p, h: jnp.tanh(h),
    "matmul": lambda p, h: h @ p["w"],
    "bias": lambda p, h: h + p["b"],
    "square": lambda p, h: 0.5 * h * h,
}
# How a layer is called: bare, or inside the user's own jit or checkpoint.
WRAPS = {
    "bare": lambda f: f,
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
}
REMATS = {
    "False": False,
    "None": None,
    "True": True,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def stage_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(FEATURES, FEATURES)) / FEATURES**0.5),
        "b": jnp.asarray(0.1 * rng.normal(size=FEATURES)),
        "s": jnp.asarray(1 + 0.1 * rng.normal(size=FEATURES)),
    }


def body_of(layers: list[tuple[str, str]]):
    """The stage ``(params, x) -> y``: a dense layer, then ``layers``."""

    def stage(params, x):
        h = x @ params["w"] + params["b"]
        for name, wrap in layers:
            h = WRAPS[wrap](LAYERS[name])(params, h)
        return h

    return stage


def split_against_vjp(stage, remat) -> None:
    """The split of ``stage`` as the pipeline runs it (its checkpoint policy
    for ``remat``): B's input cotangent and W's parameter cotangent equal
    ``jax.vjp``'s of the bare stage, in float64."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        params = stage_params()
        x, cotangent = (jnp.asarray(rng.normal(size=(ROWS, FEATURES))) for _ in "xc")
        run = jax.checkpoint(stage, policy=_stage_policy(remat))
        _, saved, pullback = forward(run, params, x)
        leaves, tree = jax.tree.flatten((params, saved, cotangent))

        def flat(*leaves):
            given = jax.tree.unflatten(tree, leaves)
            return jax.tree.leaves(backward(pullback, *given))

        split = split_backward(flat, leaves, 1, 1)
        dx, boundary = jax.jit(lambda *a: input_part(split, a))(*leaves)
        args = [*leaves[:-1], None]  # W is not handed the cotangent
        weights = jax.jit(lambda b: weight_part(split, args, b))(boundary)
        expected = jax.vjp(stage, params, x)[1](cotangent)
    assert dx[0].dtype == np.float64, dx[0].dtype
    chex.assert_trees_all_close(
        (jax.tree.unflatten(jax.tree.structure(params), weights), dx[0]),
        expected,
        rtol=SPLIT_RTOL,
        atol=SPLIT_ATOL,
    )


@pytest.mark.parametrize("remat", list(REMATS), ids=list(REMATS))
@pytest.mark.parametrize("name", list(CUSTOM))
def test_split_of_a_custom_jvp_activation_is_the_pullback(name, remat):
    """Issue 62, item 3: each of the issue's activations (a custom_jvp call)
    in a dense stage, under remat False, None, True and a checkpoint
    policy: B and W give jax.vjp's cotangents (KeyError 'subfuns' before,
    wherever the stage is rematerialised)."""
    split_against_vjp(body_of([(name, "bare")]), REMATS[remat])


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(
    layers=st.lists(
        st.tuples(st.sampled_from(list(LAYERS)), st.sampled_from(list(WRAPS))),
        min_size=1,
        max_size=4,
    ),
    remat=st.sampled_from(list(REMATS)),
)
@example(layers=[("custom_vjp", "checkpoint"), ("softplus", "jit")], remat="True")
@example(layers=[("mish", "bare"), ("matmul", "jit")], remat="dots_saveable")
def test_split_of_drawn_stage_bodies_is_the_pullback(layers, remat):
    """Stage bodies drawn from custom_jvp functions, a user's custom_vjp
    function and plain primitives, each bare or in the user's own jit or
    checkpoint, under every remat setting: B's input cotangent and W's
    parameter cotangent are jax.vjp's."""
    split_against_vjp(body_of(layers), REMATS[remat])


def test_split_rebinds_custom_jvp_and_custom_vjp_calls():
    """The split of a function whose jaxpr holds a custom_vjp_call (the
    user's function, in B) and custom_jvp_calls (softplus in B, log_sigmoid
    in W): each half re-binds them as jax.core.eval_jaxpr does, and B's and
    W's outputs are the function's."""
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        params = stage_params()
        x, cotangent = (jnp.asarray(rng.normal(size=(ROWS, FEATURES))) for _ in "xc")

        def fun(w, s, x, cotangent):
            h = scaled_tanh(x @ w, s)
            dx = jax.nn.softplus(h) * cotangent
            dw = x.T @ (jax.nn.log_sigmoid(h) * cotangent)
            return [dw, dx]

        args = [params["w"], params["s"], x, cotangent]
        jaxpr = str(jax.make_jaxpr(fun)(*args))  # softplus's call inside a jit
        assert "custom_vjp_call" in jaxpr and "custom_jvp_call" in jaxpr, jaxpr
        split = split_backward(fun, args, 1, 1)
        dx, boundary = input_part(split, args)
        dw = weight_part(split, [*args[:-1], None], boundary)
        expected = fun(*args)
    assert dx[0].dtype == np.float64, dx[0].dtype
    chex.assert_trees_all_close([*dw, *dx], expected, rtol=SPLIT_RTOL, atol=SPLIT_ATOL)


# End to end: zero-bubble on a mesh of one stage.

MESH = jax.make_mesh((1,), ("stage",))
NUM = 4


def activated(*activations):
    """A dense stage with the mean of ``activations`` of its pre-activation."""

    def stage(params, x):
        w, b = (params[name].astype(x.dtype) for name in "wb")
        z = x @ w + b
        return sum(activation(z) for activation in activations) / len(activations)

    return stage


# pipeline_checks' bound over the gradient's chain, plus the activations'
# mean: one more sum of len(CUSTOM) terms in the forward, one in the backward.
END_TO_END_RTOL = tolerance(2.0**-53, batch=BATCH + 2 * len(CUSTOM))  # 8.1e-14


@pytest.mark.parametrize("remat", list(REMATS), ids=list(REMATS))
def test_zero_bubble_with_custom_jvp_activations_is_the_sequential_model(remat):
    """Issue 62, item 3, end to end: zero-bubble's value and gradients with
    a stage using every one of the issue's activations, under each remat
    setting, equal autodiff of the sequential model on the whole batch
    (float64)."""
    stage = activated(*CUSTOM.values())
    with jax.enable_x64(True):
        params = make_params(1, np.float64)
        batch = make_batch(4 * NUM, np.float64)
        step = jaxaccum.pipeline_value_and_grad(
            stage,
            mse,
            NUM,
            mesh=MESH,
            embed_fn=embed,
            schedule="zero-bubble",
            remat=REMATS[remat],
        )
        got = jax.jit(step)(params, batch)
        expected = jax.value_and_grad(functools.partial(sequential, stage, mse))(
            params, batch
        )
    assert jax.tree.leaves(got[1])[0].dtype == np.float64
    chex.assert_trees_all_close(
        got, expected, rtol=END_TO_END_RTOL, atol=END_TO_END_RTOL
    )


def test_plan_pipeline_plans_zero_bubble_with_remat_and_softplus():
    """Issue 62, item 3: plan_pipeline(remat=True) compiles zero-bubble's
    step for a stage using softplus (it failed as the step did)."""
    plan = jaxaccum.plan_pipeline(
        activated(jax.nn.softplus),
        mse,
        make_params(1),
        make_batch(8),
        memory_budget="1GiB",
        mesh=MESH,
        embed_fn=embed,
        schedule="zero-bubble",
        candidates=[2],
        remat=True,
    )
    assert plan.schedule == "zero-bubble" and plan.remat is True, plan


# remat=None is no remat (item 2).


def test_remat_none_runs_zero_bubbles_tables_without_remat():
    """At S = M = 4 zero-bubble's window without remat is 3 M + S = 16
    units (a tick over ZB-H1's, at its memory; 17 with remat's tables); None
    is no remat."""
    plain = ZeroBubble.for_window(4, 4, 1, None)
    assert plain == ZeroBubble.for_window(4, 4, 1, False), plain
    assert plain.modeled_window() == 16, plain.modeled_window()
    assert ZeroBubble.for_window(4, 4, 1, True).modeled_window() == 17


def fake_row(functions, options, mesh, args):
    """``_measure`` without compiling: a row of a fixed footprint."""
    del functions, mesh, args
    return PipelinePlanRow(
        num_microbatches=options.num_microbatches,
        schedule=options.layout.schedule,
        remat=options.remat,
        batch_size=options.num_microbatches,
        bubble=0.0,
        efficiency=0.0,
        temp_bytes=1,
        total_bytes=1,
        compile_seconds=0.0,
        fits=False,
    )


def test_plan_pipeline_remat_none_is_planned_and_labelled_as_no_remat():
    """plan_pipeline(remat=None) at S = M = 4 (the compiles stubbed: the
    bubble and the label are the planner's, not the compiler's): bubble
    S / (3 M + S) = 4 / 16 = 0.250, efficiency 0.75 (no forward
    recomputed), its rows labelled None (not "policy")."""
    params = make_params(4)
    with (
        unittest.mock.patch(
            "jaxaccum._pipeline._plan._recompute", lambda *_: (1 / 3, False)
        ),
        unittest.mock.patch("jaxaccum._pipeline._plan._measure", fake_row),
    ):
        plan = jaxaccum.plan_pipeline(
            activated(jnp.tanh),
            mse,
            params,
            make_batch(4),
            memory_budget="1GiB",
            mesh=AbstractMesh((4,), ("stage",)),
            embed_fn=embed,
            schedule="zero-bubble",
            candidates=[4],
            remat=None,
        )
    assert plan.bubble == pytest.approx(4 / 16), plan.bubble
    assert plan.efficiency == pytest.approx(12 / 16), plan.efficiency
    header, columns, row = str(plan).splitlines()
    assert "remat=None" in header, header
    assert row.split()[columns.split().index("remat")] == "None", row
