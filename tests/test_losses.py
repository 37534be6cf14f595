"""jaxaccum.losses: the blockwise contrastive losses equal their formulas.

The claim is the formula's value and gradients up to float32 rounding, and,
near convergence where that bound is loose, a value and a scale's gradient no
further from float64 than the formula's own in float32
(``test_near_convergence_no_further_from_float64_than_the_formula``). The
truth is the formula in float64 (numpy, independent of JAX); a float32 result,
the blockwise loss's or the formula's own, errs from it by at most the bound
``_bounds`` derives, per element, from the magnitudes of the terms (Higham,
"Accuracy and Stability of Numerical Algorithms", 3.1 and 4.2), with
``u = 2**-24``:

- A logit is a D-term dot product, scaled and biased. In two orders it errs
  by ``2 (D + 2) u P`` at most, ``P = |scale| max|x_i| max|y_j| + |bias|``
  bounding every logit (Cauchy-Schwarz). exp, log and log-sigmoid add a few
  ulps of values up to P: ``e = 2 (D + 2) u P + 8 u (1 + P)`` bounds the
  error of a logit and of a term computed from it (every term is 1-Lipschitz
  in its logit: a log-sum-exp, a log-sigmoid).
- A sum of n terms errs by ``(n - 1) u sum|t|`` in any order; two orders by
  twice that. The softmax's log-sum-exps are sums of B exponentials, rescaled
  once per block (nb blocks): ``2 (B + nb) u`` relative, which the log turns
  absolute.
- Gradients are ``dL/ds`` (G, B x B) pulled back: ``dx = scale G y``, ``dy =
  scale G^T x``, ``dscale = sum G_ij (x_i . y_j)``, ``dbias = sum G``. An entry
  of G errs relatively by ``eps_G`` (a softmax probability by its logit's and
  log-sum-exp's errors, a sigmoid by its logit's), and each contraction adds
  its own sum's rounding, so ``|d dx| <= |scale| (eps_G + 2 (B + 1) u) |G| |y|``
  and likewise for the others (the sums over all pairs have B² terms).

The tests' data are unit-norm rows, B <= 64, D <= 32, scales up to 20: the
bounds are at most 5e-4 of the value and of the largest x and y gradient
(3e-2 of the scale's, whose sums run over all B² pairs), where a real mistake
(an unmasked padded row, a mean over B - 1, a block counted twice) moves the
value by 1e-2 and more (``test_the_bound_catches_wrong_answers``). Measured,
the errors are under 1% of the bounds: they are worst cases, not estimates.
"""

import functools
import math
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import losses_checks
import numpy as np
import pytest
from check_scripts import run_script, selected_checks
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_checks import CHECKS as SHARD_MAP_CHECKS
from tolerances import ATOL, RTOL

import jaxaccum

UNIT_ROUNDOFF = 2.0**-24  # float32
LEAVES = ("value", "x", "y", "scale", "bias")


def _embeddings(batch: int, dim: int, seed: int, dtype=np.float32):
    """Two (B, D) arrays of unit-norm rows, like CLIP's normalised embeddings."""
    rng = np.random.default_rng(seed)
    pair = rng.standard_normal((2, batch, dim))
    pair /= np.linalg.norm(pair, axis=-1, keepdims=True)
    return pair[0].astype(dtype), pair[1].astype(dtype)


def _blockwise(kind, x, y, scale, bias, block_size, jit=True):
    """Value and gradients of jaxaccum.losses' loss, keyed like LEAVES."""
    if kind == "softmax":

        def loss(x, y, scale, bias):
            del bias
            return jaxaccum.losses.softmax_contrastive(
                x, y, scale, block_size=block_size
            )
    else:

        def loss(x, y, scale, bias):
            return jaxaccum.losses.sigmoid_contrastive(
                x, y, scale, bias, block_size=block_size
            )

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    value, grads = (jax.jit(step) if jit else step)(x, y, scale, bias)
    return dict(zip(LEAVES, (value, *grads), strict=True))


# The straightforward formula in JAX (the B x B logits at once), the one the
# 8-device checks compare with too.
_formula = losses_checks.formula


def _formula_jax(kind, x, y, scale, bias):
    """The formula's value and gradients, keyed like LEAVES."""
    loss = functools.partial(_formula, kind)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    value, grads = step(x, y, scale, bias)
    return dict(zip(LEAVES, (value, *grads), strict=True))


def _truth(kind, x, y, scale, bias):
    """The formula in float64 numpy: value and gradients, and the magnitudes of
    G = dL/dlogits before it cancels (a softmax's -2 on the diagonal cancels
    its probabilities' sum at B = 1, to 0 exactly)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    batch, raw = x.shape[0], x @ y.T
    logits = scale * raw + (bias if kind == "sigmoid" else 0.0)
    if kind == "softmax":
        row_lse = np.logaddexp.reduce(logits, axis=1)
        col_lse = np.logaddexp.reduce(logits, axis=0)
        value = (row_lse.sum() + col_lse.sum() - 2 * np.trace(logits)) / (2 * batch)
        probs = np.exp(logits - row_lse[:, None]) + np.exp(logits - col_lse[None, :])
        grad_logits = (probs - 2 * np.eye(batch)) / (2 * batch)
        magnitude = (probs + 2 * np.eye(batch)) / (2 * batch)
    else:
        labels = 2 * np.eye(batch) - 1
        value = np.logaddexp(0.0, -labels * logits).sum() / batch
        grad_logits = -labels / (1 + np.exp(labels * logits)) / batch
        magnitude = np.abs(grad_logits)
    leaves = {
        "value": value,
        "x": scale * grad_logits @ y,
        "y": scale * grad_logits.T @ x,
        "scale": np.sum(grad_logits * raw),
        "bias": np.sum(grad_logits) if kind == "sigmoid" else 0.0,
    }
    return leaves, magnitude


def _bounds(kind, x, y, scale, bias, block_size):
    """Per element, what float32 rounding can move each leaf by (module doc)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    (batch, dim), u = x.shape, UNIT_ROUNDOFF
    num_blocks = math.ceil(batch / min(block_size, batch))
    truth, magnitude = _truth(kind, x, y, scale, bias)
    norms_x, norms_y = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    bias = bias if kind == "sigmoid" else 0.0
    largest = abs(scale) * norms_x.max() * norms_y.max() + abs(bias)
    term = 2 * (dim + 2) * u * largest + 8 * u * (1 + largest)
    if kind == "softmax":
        lse = term + 2 * (batch + num_blocks) * u
        eps_g = 2 * lse + 4 * u
        value = 2 * lse + 8 * batch * u * (largest + math.log(batch) + 1)
    else:
        eps_g = term + 4 * u
        value = term * magnitude.sum() + 2 * (batch**2 + 4) * u * truth["value"]
    pairs = 2 * (dim + batch**2) * u
    return {
        "value": value,
        "x": abs(scale) * (eps_g + 2 * (batch + 1) * u) * magnitude @ np.abs(y),
        "y": abs(scale) * (eps_g + 2 * (batch + 1) * u) * magnitude.T @ np.abs(x),
        "scale": (eps_g + pairs) * np.sum(magnitude * np.outer(norms_x, norms_y)),
        "bias": (eps_g + pairs) * magnitude.sum() if kind == "sigmoid" else 0.0,
    }


def assert_within_rounding(kind, got, x, y, scale, bias, block_size):
    """Every leaf within its bound of the float64 formula, per element."""
    truth, _ = _truth(kind, x, y, scale, bias)
    bounds = _bounds(kind, x, y, scale, bias, block_size)
    for leaf in LEAVES:
        error = np.abs(np.asarray(got[leaf], np.float64) - truth[leaf])
        worst = np.max(error / np.maximum(bounds[leaf], np.finfo(np.float64).tiny))
        assert np.all(error <= bounds[leaf]), (
            f"{kind} contrastive, leaf {leaf!r} (B={x.shape[0]}, D={x.shape[1]}, "
            f"block_size={block_size}): error up to {worst:.3g}x the float32 "
            f"rounding bound; max error {np.max(error):.3g}"
        )


# (B, block_size): dividing B, not dividing it, equal to it, beyond it, B = 1.
SHAPES = [(64, 16), (64, 24), (37, 5), (64, 64), (20, 512), (1, 512)]
SETTINGS = {"softmax": (20.0, 0.0), "sigmoid": (10.0, -10.0)}  # CLIP's, SigLIP's


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("batch, block_size", SHAPES)
def test_value_and_gradients_are_the_formulas_within_float32_rounding(
    kind, batch, block_size
):
    """The blockwise loss and the B x B formula (in float32) both lie within
    float32 rounding of the formula in float64: value, x, y, scale, bias."""
    x, y = _embeddings(batch, 32, seed=batch)
    scale, bias = SETTINGS[kind]
    got = _blockwise(kind, x, y, np.float32(scale), np.float32(bias), block_size)
    assert_within_rounding(kind, got, x, y, scale, bias, block_size)
    formula = _formula_jax(kind, x, y, np.float32(scale), np.float32(bias))
    assert_within_rounding(kind, formula, x, y, scale, bias, block_size)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_the_bound_catches_wrong_answers(kind):
    """A test that cannot fail is none: a mean over B - 1, and the padded rows
    of a last block left unmasked, each break the bound."""
    x, y = _embeddings(37, 32, seed=1)
    scale, bias = SETTINGS[kind]
    got = _blockwise(kind, x, y, np.float32(scale), np.float32(bias), 5)
    wrong_mean = {leaf: got[leaf] * 37 / 36 for leaf in LEAVES}
    with pytest.raises(AssertionError, match="leaf 'value'"):
        assert_within_rounding(kind, wrong_mean, x, y, scale, bias, 5)
    # Three zero rows of x, as an unmasked last block of 5 would score them.
    padded = np.concatenate([x, np.zeros((3, 32), np.float32)])
    unmasked = _formula_jax(kind, padded, np.concatenate([y, y[:3]]), scale, bias)
    unmasked["x"], unmasked["y"] = unmasked["x"][:37], unmasked["y"][:37]
    unmasked["value"] = unmasked["value"] * 40 / 37
    with pytest.raises(AssertionError, match="leaf 'value'"):
        assert_within_rounding(kind, unmasked, x, y, scale, bias, 5)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_float64_is_the_formula_within_1e_12(kind):
    x, y = _embeddings(37, 16, seed=2, dtype=np.float64)
    scale, bias = SETTINGS[kind]
    with jax.enable_x64(True):
        got = _blockwise(kind, x, y, np.float64(scale), np.float64(bias), 5)
        assert got["value"].dtype == jnp.float64
    truth, _ = _truth(kind, x, y, scale, bias)
    chex.assert_trees_all_close(
        {leaf: np.asarray(got[leaf]) for leaf in LEAVES},
        truth,
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_jit_and_grad_of_jit_equal_the_eager_result(kind):
    x, y = _embeddings(24, 8, seed=3)
    scale, bias = np.float32(SETTINGS[kind][0]), np.float32(SETTINGS[kind][1])
    eager = _blockwise(kind, x, y, scale, bias, 7, jit=False)
    jitted = _blockwise(kind, x, y, scale, bias, 7)
    if kind == "softmax":
        loss = jax.jit(
            lambda x, y, s: jaxaccum.losses.softmax_contrastive(x, y, s, block_size=7)
        )
        grads = jax.grad(loss, argnums=(0, 1, 2))(x, y, scale)
    else:
        loss = jax.jit(
            lambda x, y, s, b: jaxaccum.losses.sigmoid_contrastive(
                x, y, s, b, block_size=7
            )
        )
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, y, scale, bias)
    names = ("x", "y", "scale", "bias")[: len(grads)]
    grad_of_jit = {
        "value": eager["value"],
        "bias": 0.0,
        **dict(zip(names, grads, strict=True)),
    }
    # Each program rounds its own way: both within the derived bound.
    for got in (eager, jitted, grad_of_jit):
        assert_within_rounding(kind, got, x, y, scale, bias, 7)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_bfloat16_inputs_are_summed_in_float32(kind):
    """bfloat16 embeddings: the loss comes back in float32 within float32
    rounding of the formula on the same (bfloat16) numbers, which summing in
    bfloat16 (8 bits) would miss by far; gradients keep the inputs' dtype."""
    x32, y32 = _embeddings(48, 32, seed=4)
    x, y = jnp.asarray(x32, jnp.bfloat16), jnp.asarray(y32, jnp.bfloat16)
    scale, bias = SETTINGS[kind]
    got = _blockwise(kind, x, y, np.float32(scale), np.float32(bias), 20)
    assert got["value"].dtype == jnp.float32
    assert got["x"].dtype == got["y"].dtype == jnp.bfloat16
    truth, _ = _truth(kind, x, y, scale, bias)
    bounds = _bounds(kind, x, y, scale, bias, 20)
    assert abs(float(got["value"]) - truth["value"]) <= bounds["value"]
    assert abs(float(got["scale"]) - truth["scale"]) <= bounds["scale"]
    # The gradients are rounded to bfloat16 once, at the end: half an ulp.
    for leaf in ("x", "y"):
        reference = np.asarray(truth[leaf])
        error = np.abs(np.asarray(got[leaf], np.float64) - reference)
        assert np.all(error <= 2.0**-8 * np.abs(reference) + bounds[leaf]), leaf


def _converged(batch: int, seed: int):
    """Unit-norm pairs near convergence: y is x nudged by noise of 0.12 (D =
    64), so at scale 100 a positive's logit leads most of its row's and
    column's others by 50 and more: the loss is 6.5e-6 at B = 1024 where a
    term's log-sum-exp is near 100."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y = x + 0.12 * rng.standard_normal((batch, 64))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    return x.astype(np.float32), y.astype(np.float32)


def _truth_converged(kind, x, y, scale, bias, rows=512):
    """The value and the scale's gradient in float64, a block of rows at a
    time, each term formed without cancelling: the softmax's as
    ``log1p(sum_{j != i} exp(s_ij - s_ii))``, its columns as the rows of
    ``y x^T``."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    batch = x.shape[0]
    value = dscale = 0.0
    for first, second in [(x, y), (y, x)] if kind == "softmax" else [(x, y)]:
        for start in range(0, batch, rows):
            index = np.arange(start, min(start + rows, batch))
            diagonal = (np.arange(len(index)), index)
            raw = first[index] @ second.T
            if kind == "softmax":
                distance = raw - raw[diagonal][:, None]
                exps = np.exp(scale * distance)
                exps[diagonal] = 0.0
                total = exps.sum(axis=1)
                value += np.log1p(total).sum() / (2 * batch)
                dscale += np.sum(exps * distance / (1 + total)[:, None]) / (2 * batch)
            else:
                labels = -np.ones_like(raw)
                labels[diagonal] = 1.0
                margins = labels * (scale * raw + bias)
                value += np.logaddexp(0.0, -margins).sum() / batch
                dscale -= np.sum(labels * raw / (1 + np.exp(margins))) / batch
    return {"value": value, "scale": dscale}


def _value_and_scale_gradient(loss, x, y, scale, bias):
    step = jax.jit(jax.value_and_grad(loss, argnums=2))
    value, dscale = step(x, y, np.float32(scale), np.float32(bias))
    return {"value": float(value), "scale": float(dscale)}


# SigLIP's terms are non-negative and its scale's gradient one sum of the
# pairs' (the formula's own): it is checked where it is cheap, at B = 1024.
@pytest.mark.parametrize(
    "kind, batch", [("softmax", 1024), ("softmax", 8192), ("sigmoid", 1024)]
)
def test_near_convergence_no_further_from_float64_than_the_formula(kind, batch):
    """At CLIP's scale of 100, near convergence (values near 1e-5 made of
    terms whose log-sum-exps are near 100), the blockwise value and scale's
    gradient are no further from float64 than the B x B formula in float32:
    at most twice its error plus 4 ulps (float32's, of the value). The
    softmax's value was a difference of sums that grow with B x scale: 800x
    the formula's error at B = 1024, 650x at B = 8192."""
    x, y = _converged(batch, seed=batch)
    scale, bias = 100.0, -10.0
    truth = _truth_converged(kind, x, y, scale, bias)
    ours = _value_and_scale_gradient(
        (lambda x, y, s, b: jaxaccum.losses.softmax_contrastive(x, y, s))
        if kind == "softmax"
        else jaxaccum.losses.sigmoid_contrastive,
        x,
        y,
        scale,
        bias,
    )
    formula = _value_and_scale_gradient(
        functools.partial(_formula, kind),
        x,
        y,
        scale,
        bias,
    )
    for leaf in ("value", "scale"):
        ours_error = abs(ours[leaf] - truth[leaf])
        formula_error = abs(formula[leaf] - truth[leaf])
        allowed = 2 * formula_error + 4 * np.spacing(np.float32(abs(truth[leaf])))
        assert ours_error <= allowed, (
            f"{kind}, B={batch}, {leaf}: {ours[leaf]:.6g} is {ours_error:.3g} "
            f"from float64's {truth[leaf]:.6g}; the formula in float32 "
            f"({formula[leaf]:.6g}) is {formula_error:.3g} from it"
        )


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 20),
    dim=st.integers(1, 8),
    block_size=st.integers(1, 24),
    scale=st.floats(0.5, 50.0),
    bias=st.floats(-15.0, 15.0),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_block_scale_and_bias(
    batch, dim, block_size, scale, bias, seed
):
    x, y = _embeddings(batch, dim, seed)
    for kind in ("softmax", "sigmoid"):
        got = _blockwise(kind, x, y, np.float32(scale), np.float32(bias), block_size)
        assert_within_rounding(
            kind,
            got,
            x,
            y,
            float(np.float32(scale)),
            float(np.float32(bias)),
            block_size,
        )


def _temp_bytes(loss, *args) -> int:
    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_temporaries_at_b8192_are_at_most_an_eighth_of_the_formulas():
    """At B = 8192, D = 64 (compiled, not run) the B x B logits are 256 MiB;
    the blocks of 512 rows hold 16 MiB each."""
    rows = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    for kind in ("softmax", "sigmoid"):

        def formula(x, y, scale, bias, kind=kind):
            return _formula_jax(kind, x, y, scale, bias)["value"]

        blockwise = (
            (lambda x, y, s, b: jaxaccum.losses.softmax_contrastive(x, y, s))
            if kind == "softmax"
            else jaxaccum.losses.sigmoid_contrastive
        )
        ours = _temp_bytes(blockwise, rows, rows, scalar, scalar)
        theirs = _temp_bytes(formula, rows, rows, scalar, scalar)
        assert ours * 8 <= theirs, (
            f"{kind}: {ours / 2**20:.1f} MiB of temporaries, the formula's "
            f"{theirs / 2**20:.1f} MiB: {theirs / ours:.1f}x, not >= 8x"
        )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda L: L.softmax_contrastive(jnp.ones((4, 3)), jnp.ones((4, 2)), 1.0),
            r"x has shape \(4, 3\) and y \(4, 2\); both must be \(B, D\)",
        ),
        (
            lambda L: L.softmax_contrastive(jnp.ones(4), jnp.ones(4), 1.0),
            r"x has shape \(4,\) and y \(4,\)",
        ),
        (
            lambda L: L.sigmoid_contrastive(
                jnp.ones((4, 3), int), jnp.ones((4, 3), int), 1.0, 0.0
            ),
            r"x has dtype int\d+; pass floating-point",
        ),
        (
            lambda L: L.softmax_contrastive(
                jnp.ones((4, 3)), jnp.ones((4, 3)), jnp.ones(1)
            ),
            r"logit_scale has shape \(1,\) .* jnp.squeeze\(logit_scale\)",
        ),
        (
            lambda L: L.sigmoid_contrastive(
                jnp.ones((4, 3)), jnp.ones((4, 3)), 1.0, jnp.ones(2)
            ),
            r"logit_bias has shape \(2,\)",
        ),
        (
            lambda L: L.softmax_contrastive(
                jnp.ones((4, 3)), jnp.ones((4, 3)), 1.0, block_size=0
            ),
            r"block_size must be >= 1, got 0",
        ),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument_and_the_fix(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(jaxaccum.losses)


def test_the_losses_docs_write_math_as_math():
    r"""The API page renders the docstrings' \( ... \) with MathJax, as the
    other pages do: no formula in prose (a Unicode superscript, "B²")."""
    page = pathlib.Path(__file__).parents[1] / "docs" / "api" / "losses.md"
    losses = jaxaccum.losses
    texts = {
        "jaxaccum.losses": losses.__doc__,
        "softmax_contrastive": losses.softmax_contrastive.__doc__,
        "sigmoid_contrastive": losses.sigmoid_contrastive.__doc__,
        "docs/api/losses.md": page.read_text(),
    }
    for where, text in texts.items():
        prose = re.sub(r"\\\(.*?\\\)|\\\[.*?\\\]", "", text, flags=re.DOTALL)
        found = re.findall(r".{0,30}[⁰¹²³⁴⁵⁶⁷⁸⁹].{0,30}", prose)
        assert not found, rf"{where}: a formula in prose; write it as \(...\): {found}"


@pytest.mark.parametrize("integer", [10, np.int32(10), jnp.asarray(10, jnp.int16)])
def test_integer_scale_and_bias_are_taken_in_the_float_dtype(integer):
    """``logit_scale`` and ``logit_bias`` are typed ArrayLike: an int, Python
    or an integer array, is the same number in the loss's float dtype (it
    raised before); a bool, complex or non-scalar is still refused."""
    x, y = _embeddings(12, 8, seed=6)
    losses = jaxaccum.losses
    chex.assert_trees_all_equal(
        (
            losses.softmax_contrastive(x, y, integer, block_size=5),
            losses.sigmoid_contrastive(x, y, integer, -integer, block_size=5),
        ),
        (
            losses.softmax_contrastive(x, y, 10.0, block_size=5),
            losses.sigmoid_contrastive(x, y, 10.0, -10.0, block_size=5),
        ),
    )
    with jax.enable_x64(True):
        value = losses.softmax_contrastive(x.astype(np.float64), y, integer)
        assert value.dtype == jnp.float64, value.dtype
    for refused in (True, 1j, np.ones(1, int)):
        with pytest.raises(ValueError, match="must be a real scalar, an int or"):
            losses.sigmoid_contrastive(x, y, 10.0, refused)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_inside_shard_map_on_values_that_vary_between_devices(kind):
    """Under ``shard_map`` (as ``cached_value_and_grad(mesh=...)`` runs the
    loss) the inputs are typed as varying over the mesh's axis; the block
    scans' carries start typed like them (a constant start failed: carry
    types differ), and the result is the one outside ``shard_map``."""
    from jax.sharding import PartitionSpec as P

    x, y = _embeddings(24, 8, seed=5)
    scale, bias = np.float32(SETTINGS[kind][0]), np.float32(SETTINGS[kind][1])
    mesh = jax.make_mesh((1,), ("data",))

    def per_device(x, y, scale, bias):
        x, y, scale, bias = jax.lax.pcast((x, y, scale, bias), "data", to="varying")
        out = _blockwise(kind, x, y, scale, bias, 7, jit=False)
        return jax.tree.map(lambda v: jax.lax.psum(v, "data"), out)

    step = jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P())
    chex.assert_trees_all_close(
        jax.jit(step)(x, y, scale, bias),
        _blockwise(kind, x, y, scale, bias, 7),
        # the same blocks in the same order, fused in another program: float32
        # rounding of sums in two orders (tests/tolerances.py's bound)
        rtol=RTOL,
        atol=ATOL,
    )


@pytest.fixture(scope="module")
def shard_map_results(request) -> dict:
    checks = selected_checks(request)
    return run_script("losses_checks.py", num_devices=8, timeout=600, checks=checks)


@pytest.mark.parametrize("check", SHARD_MAP_CHECKS)
def test_under_shard_map_any_mix_of_varying_and_invariant_inputs(
    shard_map_results, check
):
    """Per device on 8 devices, x, y, the scale and the bias each varying over
    the devices or the same on all (a replicated temperature, an all-gathered
    y, a Python float): value and gradients of the devices' summed losses are
    the plain formula's under the same shard_map, in float64
    (tests/losses_checks.py). An invariant input's cotangent is the devices'
    sum; the backward returned it varying, which JAX refused."""
    assert shard_map_results[check]["ok"], shard_map_results[check]["detail"]
