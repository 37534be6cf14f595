"""Properties of the growth API over its options (issue 35).

(a) Units: the same run counted in examples and in tokens (T tokens an
    example, step_cost and half_life times T, ``tokens_per_example=T``) takes
    the same windows, for drawn controllers and windows. T is a power of two,
    so every quantity scales by it exactly in float32 and the comparison is
    bitwise: with another T, a tie between two sizes could round apart.
(b) ``predicted_time`` is McCandlish's formula, computed independently in
    float64 from float32 inputs. Four float32 operations each correctly
    rounded (u = 2**-24): B_noise / B, 1 + it (its error carried with a
    factor <= 1), c + B, the product: within 4 u of the float64 value; the
    test allows twice that, as tests/test_growth.py does.
(c) Every public numeric argument of the growth API takes a Python, a NumPy
    (0-d array or scalar) and a 0-d JAX value alike, and refuses huge and tiny
    floats, bools, strings and shape-(2,) arrays with jaxaccum's own error,
    which starts with the argument's name. The arguments and kinds are few,
    so they are enumerated, not drawn.
(d) ``NoiseScaleEMA`` is the per-example average of the estimates: against
    noise_average.py's float64 reimplementation, for drawn half-lives and
    windows of drawn sizes (the tolerance is derived at the test).
(e) The noise-scale controller keeps exactly that average (its moments are
    the ``NoiseScaleEMA``'s, bitwise) and decides from it: its windows are
    those the documented rule gives from the EMA's readers.

The draws are derandomized (the same each run), as in tests/test_growth.py.
The controller runs eagerly (``jax.disable_jit``): its update compiles per
controller, a second a drawn example, where eager updates take milliseconds.
"""

import math
import re
import types
from typing import NamedTuple

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from noise_average import absolute_sum_average, per_example_average

import jaxaccum.growth._step_cost
from jaxaccum.growth import (
    EXAMPLES_ONLY,
    STEPS_ONLY,
    BatchRamp,
    NoiseScaleBatch,
    NoiseScaleEMA,
    batch_scale,
    measure_step_cost,
    scale_by_batch_learning_rate,
)

UNIT_ROUNDOFF = 2.0**-24  # float32
FLOAT32 = {"width": 32, "allow_nan": False, "allow_infinity": False}


class Totals(NamedTuple):
    """The scalars of a WindowStats that the controllers read."""

    big_batch: float
    gradient_norm_sq: float
    gradient_noise_trace: float


@st.composite
def controllers_in_examples(draw):
    """``NoiseScaleBatch``'s keyword arguments, counted in examples, with a
    valid half-life (at least 2 largest windows, or the default)."""
    micro = draw(st.integers(1, 16))
    sizes = sorted(
        draw(st.lists(st.integers(2, 24), min_size=1, max_size=5, unique=True))
    )
    listed = draw(st.booleans())
    cost = draw(
        st.one_of(
            st.just(EXAMPLES_ONLY),
            st.just(STEPS_ONLY),
            st.floats(0.5, 2.0**17, **FLOAT32),
        )
    )
    kappa = draw(st.one_of(st.none(), st.floats(0.125, 8.0, **FLOAT32)))
    factor = draw(st.one_of(st.none(), st.floats(2.0, 64.0, **FLOAT32)))
    return {
        "microbatch_size": micro,
        "max_microbatches": sizes[-1],
        "min_microbatches": sizes[0],
        "sizes": tuple(sizes) if listed else None,
        "step_cost": cost,
        "kappa": kappa,
        "half_life": None
        if factor is None
        else float(np.float32(factor * sizes[-1] * micro)),
        "standard_errors": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        "shrink": draw(st.booleans()),
    }


def in_tokens(kwargs, tokens):
    """The same controller counting tokens: its unit-bearing numbers times T."""
    scaled = dict(
        kwargs, step_cost=kwargs["step_cost"] * tokens, tokens_per_example=tokens
    )
    if kwargs["half_life"] is not None:
        scaled["half_life"] = kwargs["half_life"] * tokens
    return scaled


def run_windows(controller, estimates, tokens):
    """Sizes and final state; each window is the controller's size in
    micro-batches, ``tokens`` units an example."""
    state, sizes = controller.init(), []
    for norm_sq, trace in estimates:
        num = controller.num_microbatches(state)
        big_batch = np.float32(num * controller.microbatch_size * tokens)
        window = Totals(big_batch, np.float32(norm_sq), np.float32(trace * tokens))
        state = controller.update(state, window)
        sizes.append(num)
    return sizes, state


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(
    kwargs=controllers_in_examples(),
    tokens=st.sampled_from([2, 4, 16, 256]),
    estimates=st.lists(
        st.tuples(st.floats(-1.0, 16.0, **FLOAT32), st.floats(0.0, 4096.0, **FLOAT32)),
        min_size=8,
        max_size=12,
    ),
)
def test_counting_tokens_takes_the_windows_counting_examples_takes(
    kwargs, tokens, estimates
):
    examples = NoiseScaleBatch(**kwargs)
    counted_in_tokens = NoiseScaleBatch(**in_tokens(kwargs, tokens))
    starts = (counted_in_tokens.start_microbatches, examples.start_microbatches)
    assert starts[0] == starts[1], (kwargs, tokens, starts)
    with jax.disable_jit():
        examples_sizes, examples_state = run_windows(examples, estimates, 1)
        tokens_sizes, tokens_state = run_windows(counted_in_tokens, estimates, tokens)
    assert tokens_sizes == examples_sizes, (
        kwargs,
        tokens,
        tokens_sizes,
        examples_sizes,
    )
    hypothesis.event(f"the window moved: {len(set(examples_sizes)) > 1}")
    # B_noise in tokens is T times B_noise in examples, bitwise.
    np.testing.assert_array_equal(
        counted_in_tokens.noise_scale(tokens_state),
        tokens * examples.noise_scale(examples_state),
    )


def predicted_time_float64(batch, noise_scale, step_cost):
    """McCandlish's time, $(1 + B_noise / B)(c + B)$, in float64; a negative
    noise scale (|G|^2 below 0) is an infinite one."""
    if noise_scale < 0 or np.isinf(noise_scale):
        return np.inf
    steps = 1.0 + np.float64(noise_scale) / np.float64(batch)
    if np.isinf(step_cost):
        return steps
    return steps * (np.float64(step_cost) + np.float64(batch))


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
    batch=st.floats(2.0**-7, 2.0**23, **FLOAT32),
    noise_scale=st.one_of(
        st.just(0.0),
        st.just(math.inf),
        st.floats(2.0**-10, 2.0**30, **FLOAT32),
        st.floats(-(2.0**30), -(2.0**-10), **FLOAT32),
    ),
    step_cost=st.one_of(
        st.just(EXAMPLES_ONLY),
        st.just(STEPS_ONLY),
        st.floats(2.0**-7, 2.0**23, **FLOAT32),
    ),
)
def test_predicted_time_is_mccandlish_formula(batch, noise_scale, step_cost):
    controller = NoiseScaleBatch(8, 64, step_cost=step_cost, sizes=(2, 64))
    got = float(controller.predicted_time(batch, noise_scale))
    expected = predicted_time_float64(batch, noise_scale, step_cost)
    if np.isinf(expected):
        assert got == expected, (batch, noise_scale, step_cost, got)
    else:
        np.testing.assert_allclose(
            got,
            expected,
            rtol=2 * 4 * UNIT_ROUNDOFF,
            err_msg=f"batch {batch}, B_noise {noise_scale}, c {step_cost}",
        )


# (c) Each public numeric argument: how to call with it, and its valid value
# (exact in float32, so a JAX float32 value is the same number).
def controller_with(**kwargs):
    return NoiseScaleBatch(**({"microbatch_size": 8, "max_microbatches": 64} | kwargs))


def step_cost_with(monkeypatch, **kwargs):
    """``measure_step_cost`` on a fake clock: 4 ms a step, 1 ms an example."""
    clock = [0.0]
    monkeypatch.setattr(
        jaxaccum.growth._step_cost,
        "time",
        types.SimpleNamespace(perf_counter=lambda: clock[0]),
    )

    def window_step(num):
        clock[0] += 0.004 + 0.001 * 4 * num

    arguments = {
        "microbatch_size": 4,
        "num_microbatches": (1, 8),
        "repeats": 3,
    } | kwargs
    return measure_step_cost(window_step, **arguments)


def transform_with(
    learning_rate=0.5, base_batch=64.0, noise_half_life=512.0, batch_size=256.0
):
    """One adascale update: the state it leaves, as Python floats."""
    optimizer = scale_by_batch_learning_rate(
        learning_rate, base_batch, "adascale", noise_half_life=noise_half_life
    )
    state = optimizer.init(jnp.zeros(2))
    estimates = Totals(256.0, np.float32(1.0), np.float32(64.0))
    _, state = optimizer.update(
        jnp.ones(2), state, batch_size=batch_size, noise_estimates=estimates
    )
    return jax.tree.map(float, state)


def ema_with(half_life):
    ema = NoiseScaleEMA(half_life)
    estimates = Totals(256.0, np.float32(1.0), np.float32(64.0))
    return ema.half_life, float(ema.noise_scale(ema.update(ema.init(), estimates)))


def predicted_with(batch=64.0, noise_scale=192.0):
    return float(controller_with(step_cost=64.0).predicted_time(batch, noise_scale))


ARGUMENTS = {
    # name in the message: (call with the value, valid value, integer)
    "NoiseScaleBatch microbatch_size": (
        lambda v, _: controller_with(microbatch_size=v),
        8,
        True,
    ),
    "NoiseScaleBatch max_microbatches": (
        lambda v, _: controller_with(max_microbatches=v),
        64,
        True,
    ),
    "NoiseScaleBatch min_microbatches": (
        lambda v, _: controller_with(min_microbatches=v),
        4,
        True,
    ),
    "NoiseScaleBatch sizes[1]": (
        lambda v, _: controller_with(sizes=(2, v, 64)),
        8,
        True,
    ),
    "NoiseScaleBatch step_cost": (
        lambda v, _: controller_with(step_cost=v),
        64.0,
        False,
    ),
    "NoiseScaleBatch kappa": (lambda v, _: controller_with(kappa=v), 0.5, False),
    "NoiseScaleBatch half_life": (
        lambda v, _: controller_with(half_life=v),
        4096.0,
        False,
    ),
    "NoiseScaleBatch standard_errors": (
        lambda v, _: controller_with(standard_errors=v),
        2.0,
        False,
    ),
    "NoiseScaleBatch tokens_per_example": (
        lambda v, _: controller_with(tokens_per_example=v),
        4.0,
        False,
    ),
    "BatchRamp microbatch_size": (lambda v, _: BatchRamp(v, {0: 1, 64: 2}), 8, True),
    "BatchRamp schedule[64]": (lambda v, _: BatchRamp(8, {0: 1, 64: v}), 2, True),
    "batch_scale batch_size": (
        lambda v, _: float(batch_scale("adascale", v, 64.0, 1.0, 64.0)),
        256.0,
        False,
    ),
    "batch_scale base_batch": (
        lambda v, _: float(batch_scale("adascale", 256.0, v, 1.0, 64.0)),
        64.0,
        False,
    ),
    "batch_scale gradient_norm_sq": (
        lambda v, _: float(batch_scale("adascale", 256.0, 64.0, v, 64.0)),
        1.0,
        False,
    ),
    "batch_scale gradient_noise_trace": (
        lambda v, _: float(batch_scale("adascale", 256.0, 64.0, 1.0, v)),
        64.0,
        False,
    ),
    "scale_by_batch_learning_rate learning_rate": (
        lambda v, _: transform_with(learning_rate=v),
        0.5,
        False,
    ),
    "scale_by_batch_learning_rate base_batch": (
        lambda v, _: transform_with(base_batch=v),
        64.0,
        False,
    ),
    "scale_by_batch_learning_rate noise_half_life": (
        lambda v, _: transform_with(noise_half_life=v),
        512.0,
        False,
    ),
    "scale_by_batch_learning_rate batch_size": (
        lambda v, _: transform_with(batch_size=v),
        256.0,
        False,
    ),
    "measure_step_cost microbatch_size": (
        lambda v, mp: step_cost_with(mp, microbatch_size=v),
        4,
        True,
    ),
    "measure_step_cost num_microbatches[0]": (
        lambda v, mp: step_cost_with(mp, num_microbatches=(v, 8)),
        1,
        True,
    ),
    "measure_step_cost num_microbatches[1]": (
        lambda v, mp: step_cost_with(mp, num_microbatches=(1, v)),
        8,
        True,
    ),
    "measure_step_cost repeats": (lambda v, mp: step_cost_with(mp, repeats=v), 3, True),
    "NoiseScaleEMA half_life": (lambda v, _: ema_with(v), 512.0, False),
    "predicted_time batch": (lambda v, _: predicted_with(batch=v), 64.0, False),
    "predicted_time noise_scale": (
        lambda v, _: predicted_with(noise_scale=v),
        192.0,
        False,
    ),
}
KINDS = {
    "python": lambda value: value,
    "numpy 0-d": np.asarray,
    "numpy scalar": lambda value: (
        np.int32(value) if isinstance(value, int) else np.float64(value)
    ),
    "jax 0-d": jnp.asarray,
}
BAD_VALUES = {
    "huge": 1e300,
    "tiny": 1e-300,
    "bool": True,
    "string": "8",
    "shape (2,)": np.full(2, 8.0),
    "jax shape (2,)": jnp.full(2, 8),
}


def argument_name(case):
    return case.split(" ", 1)[1]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("case", sorted(ARGUMENTS))
def test_numeric_arguments_take_python_numpy_and_jax_values_alike(
    case, kind, monkeypatch
):
    call, valid, _ = ARGUMENTS[case]
    expected = call(valid, monkeypatch)
    got = call(KINDS[kind](valid), monkeypatch)
    assert got == expected, (case, kind, got, expected)
    if hasattr(
        got, "__dataclass_fields__"
    ):  # a controller: hashable, of Python numbers
        assert hash(got) == hash(expected), case
        for value in vars(got).values():
            assert value is None or isinstance(value, bool | int | float | tuple), got


@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
@pytest.mark.parametrize("case", sorted(ARGUMENTS))
def test_numeric_arguments_refuse_bad_values_naming_themselves(case, bad, monkeypatch):
    call, _, integer = ARGUMENTS[case]
    name = argument_name(case)
    with pytest.raises((ValueError, TypeError)) as raised:
        call(BAD_VALUES[bad], monkeypatch)
    assert str(raised.value).startswith(name), (case, bad, str(raised.value))


@pytest.mark.parametrize("case", sorted(c for c in ARGUMENTS if ARGUMENTS[c][2]))
def test_counts_refuse_floats_and_values_beyond_int32(case, monkeypatch):
    call, valid, _ = ARGUMENTS[case]
    name = re.escape(argument_name(case))
    with pytest.raises(TypeError, match=rf"^{name} must be an integer scalar"):
        call(valid + 0.5, monkeypatch)
    with pytest.raises(ValueError, match=rf"^{name} must be at most 2\*\*31 - 1"):
        call(2**40, monkeypatch)


def test_a_controller_of_jax_values_runs_its_jitted_update():
    """0-d JAX values of the controller's reals failed at ``update`` with
    "Non-hashable static arguments": they are kept as Python numbers."""
    arguments = {
        "step_cost": 64.0,
        "kappa": 0.5,
        "half_life": 4096.0,
        "standard_errors": 2.0,
    }
    python = controller_with(**arguments)
    from_jax = controller_with(
        **{name: jnp.float32(v) for name, v in arguments.items()}
    )
    window = Totals(np.float32(16.0), np.float32(1.0), np.float32(64.0))
    states = [c.update(c.init(), window) for c in (python, from_jax)]
    jax.tree.map(np.testing.assert_array_equal, *states)
    assert NoiseScaleBatch(**vars(from_jax)) == python


# (d) The average, per example. In float32 each window's factor
# k = 2**(-B / h) is within 8 u of its value (B / h rounded, then exp2, a few
# u), so its weight 1 - k is within 8 u k / (1 - k) + u; the later factors
# multiply in 8 u each and the multiply-adds 2 u each: every window's weight
# within e = 8 u (1 + k / (1 - k)) + 10 n u of its own, for n windows. The
# average is a ratio of two such weighted sums: within 2 e of the average of
# the estimates' magnitudes. Windows of h / 16 to 4 h keep k / (1 - k) <= 23.
@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(
    half_life=st.floats(16.0, 2.0**20, **FLOAT32),
    windows=st.lists(
        st.tuples(
            st.floats(1 / 16, 4.0, **FLOAT32),
            st.floats(-4.0, 16.0, **FLOAT32),
            st.floats(0.0, 4096.0, **FLOAT32),
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_noise_scale_ema_is_the_per_example_average(half_life, windows):
    ema = NoiseScaleEMA(half_life)
    totals = [
        Totals(np.float32(size * half_life), np.float32(n), np.float32(t))
        for size, n, t in windows
    ]
    moments = ema.init()
    with jax.disable_jit():
        for window in totals:
            moments = ema.update(moments, window)
    got = (ema.gradient_norm_sq(moments), ema.gradient_noise_trace(moments))
    expected = per_example_average(totals, half_life)
    largest_factor = 2.0 ** -min(size for size, _, _ in windows)
    error = 8 * UNIT_ROUNDOFF * (1 + largest_factor / (1 - largest_factor))
    error += 10 * len(windows) * UNIT_ROUNDOFF
    scale = absolute_sum_average(totals, half_life)
    for name, value, want, size in zip(
        ("|G|^2", "tr(Sigma)"), got, expected, scale, strict=True
    ):
        assert abs(float(value) - want) <= 2 * error * size, (name, value, want)
    assert int(moments.num_windows) == len(windows)


def next_size_float64(controller, phi, standard_error, effective, weight, window):
    """The documented rule from the EMA's readers, in float64: move once 4
    effective windows are in, and only where the band phi +- z se puts the
    target wholly on one side of the window; grow to its near end (shrink, if
    allowed, to its far end once that is half the window or less). Also the
    sizes of a near tie (scores within 1e-4), which float32 may order apart."""
    sizes = np.asarray(controller.possible_num_microbatches)

    def best(phi):
        batches = sizes * weight
        if controller.kappa is not None:
            tiny = np.finfo(np.float32).tiny
            score = np.abs(np.log(batches * np.maximum(phi, tiny) / controller.kappa))
        elif controller.step_cost == EXAMPLES_ONLY:
            score = batches
        else:
            steps = (np.maximum(phi, 0.0) * batches + 1.0) / batches
            score = (
                steps
                if np.isinf(controller.step_cost)
                else steps * (controller.step_cost + batches)
            )
        ties = sizes[score <= score.min() * (1 + 1e-4) + 1e-30]
        return int(sizes[np.argmin(score)]), set(ties.tolist())

    if not effective >= 4.0:
        return {window}
    band = controller.standard_errors * standard_error
    (smallest, smallest_ties), (largest, largest_ties) = (
        best(phi + band),
        best(phi - band),
    )
    if smallest > window:
        return {size for size in smallest_ties if size > window} | {smallest}
    if controller.shrink and 2 * largest <= window:
        return {size for size in largest_ties if 2 * size <= window} | {largest}
    return {window}


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
    kwargs=controllers_in_examples(),
    estimates=st.lists(
        st.tuples(st.floats(-1.0, 16.0, **FLOAT32), st.floats(0.0, 4096.0, **FLOAT32)),
        min_size=8,
        max_size=12,
    ),
)
def test_the_controller_decides_from_the_noise_scale_ema(kwargs, estimates):
    controller = NoiseScaleBatch(**kwargs)
    ema = controller.noise_ema
    assert ema == NoiseScaleEMA(controller.effective_half_life)
    state, moments, sizes = controller.init(), ema.init(), []
    with jax.disable_jit(), np.errstate(divide="ignore", invalid="ignore"):
        for norm_sq, trace in estimates:
            num = controller.num_microbatches(state)
            window = Totals(
                np.float32(num * controller.microbatch_size),
                np.float32(norm_sq),
                np.float32(trace),
            )
            state = controller.update(state, window)
            moments = ema.update(moments, window)
            jax.tree.map(np.testing.assert_array_equal, state.noise, moments)
            weight = float(state.examples_seen.total) / int(state.microbatches_seen)
            allowed = next_size_float64(
                controller,
                np.float64(ema.gradient_norm_sq(moments))
                / np.float64(ema.gradient_noise_trace(moments)),
                float(ema.standard_error(moments)),
                float(ema.effective_windows(moments)),
                weight,
                num,
            )
            got = controller.num_microbatches(state)
            assert got in allowed, (kwargs, num, got, allowed)
            sizes.append(got)
    hypothesis.event(f"the window moved: {len(set(sizes)) > 1}")
