"""Convolutions inside the window's loop run the full batch's kernels
(issue 73): on CPU, ``conv_layout="auto"`` rewrites each convolution inside
the window's loop into the layout of XLA:CPU's fast kernel, which XLA gives
convolutions outside loops only (the kernel gradient's convolution stays
``f01b_i01o->01bf`` inside a loop, 6 to 19 times slower).

What is checked: the compiled program's convolutions inside loops, read from
its HLO, are all canonical through every in-step front end, and ``"traced"``
(the off switch) leaves the slow one there; a 1x1 convolution's kernel
gradient is a dot, a transposed convolution's has no reversed window; and
the rewrite changes the numbers no more than the order of their sums does:
over the convolution's options (strides, padding, dilations, groups,
transposed, kernel sizes, 1 or 2 spatial dimensions, NCHW or NHWC), the
window's value and gradients equal the untouched window's and the big
batch's in float64 within 1e-12 (float64 rounding is below 1e-14 here).
Speed is measured in ``benchmarks/model_classes.py``, not here.
"""

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jaxaccum
import jaxaccum.equinox
import jaxaccum.flax
from jaxaccum._plan._hlo import find_convolutions

FLOAT64_TOL = 1e-12
AXIS = "window"


def _images(dtype=jnp.float32, batch=8, size=8, channels=4):
    return jax.random.normal(jax.random.key(0), (batch, size, size, channels), dtype)


def _conv_loss(kernel, images):
    dn = ("NHWC", "HWIO", "NHWC")
    hidden = lax.conv_general_dilated(
        images, kernel, (1, 1), "SAME", dimension_numbers=dn
    )
    return jnp.mean(jnp.tanh(hidden) ** 2)


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        return nn.Conv(2, (3, 3), strides=2)(x).mean()


class _NNXNet(nnx.Module):
    def __init__(self):
        self.conv = nnx.Conv(4, 4, (3, 3), rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.mean(self.norm(self.conv(x)) ** 2)


def _steps() -> dict:
    """Each in-step front end's compiled window (N = 4) on a conv model, for
    ``conv_layout``."""
    images = _images()
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 4)) / 6
    linen = _LinenNet()
    variables = linen.init(jax.random.key(2), images)
    conv = eqx.nn.Conv2d(4, 4, 3, padding=1, key=jax.random.key(3))
    mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Explicit,))

    def axis_loss(kernel, images):  # BatchNorm over the window
        dn = ("NHWC", "HWIO", "NHWC")
        hidden = lax.conv_general_dilated(
            images, kernel, (1, 1), "SAME", dimension_numbers=dn
        )
        mean = lax.pmean(jnp.mean(hidden, (0, 1, 2)), AXIS)
        return jnp.mean((hidden - mean) ** 2)

    def compile_all(layout: str) -> dict:
        options = {"conv_layout": layout}
        core = jaxaccum.value_and_grad(_conv_loss, 4, **options)
        grad = jaxaccum.grad(_conv_loss, 4, **options)
        axis = jaxaccum.value_and_grad(axis_loss, 4, axis_name=AXIS, **options)
        shard = jaxaccum.shard_value_and_grad(_conv_loss, 4, mesh=mesh, **options)
        flax_step = jaxaccum.flax.linen_value_and_grad(
            lambda v, x: linen.apply(v, x), 4, **options
        )
        eqx_step = jaxaccum.equinox.filter_value_and_grad(
            lambda model, x: jnp.mean(jax.vmap(model)(jnp.moveaxis(x, 3, 1)) ** 2),
            4,
            **options,
        )

        def nnx_step(graphdef, state, x):
            model = nnx.merge(graphdef, state)
            return jaxaccum.flax.nnx_value_and_grad(lambda m, x: m(x), 4, **options)(
                model, x
            )

        graphdef, state = nnx.split(_NNXNet())
        calls = {
            "value_and_grad": (core, kernel, images),
            "grad": (grad, kernel, images),
            "axis_name": (axis, kernel, images),
            "shard_value_and_grad": (shard, kernel, images),
            "linen": (flax_step, variables, images),
        }
        compiled = {
            name: jax.jit(fun).lower(*args).compile()
            for name, (fun, *args) in calls.items()
        }
        compiled["equinox"] = eqx_step_compiled(eqx_step, conv, images)
        compiled["nnx"] = (
            jax.jit(nnx_step, static_argnums=0).lower(graphdef, state, images).compile()
        )
        return compiled

    return {layout: compile_all(layout) for layout in ("auto", "traced")}


def eqx_step_compiled(step, model, images):
    params, static = eqx.partition(model, eqx.is_array)
    return (
        jax.jit(lambda p, x: step(eqx.combine(p, static), x))
        .lower(params, images)
        .compile()
    )


@pytest.fixture(scope="module")
def compiled_steps():
    return _steps()


def test_every_front_ends_loop_runs_canonical_convolutions(compiled_steps):
    """On CPU, the default puts every convolution in the window's loop in
    the fast kernel's layout; the off switch leaves the kernel gradient's in
    the slow one (so this test can fail)."""
    assert jax.default_backend() == "cpu"
    for name, compiled in compiled_steps["auto"].items():
        in_loop = [c for c in find_convolutions(compiled) if c.in_loop]
        assert in_loop, f"{name}: no convolution in the window's loop"
        slow = [c.dim_labels for c in in_loop if not c.canonical]
        assert not slow, f"{name}: convolutions in the loop in the slow layout {slow}"
    for name, compiled in compiled_steps["traced"].items():
        slow = [c for c in find_convolutions(compiled) if c.in_loop and not c.canonical]
        assert slow, f"{name} with conv_layout='traced': no slow convolution left"


_LAYOUTS = {2: ("NHWC", "HWIO", "NHWC"), 1: ("NWC", "WIO", "NWC")}


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    spatial=st.sampled_from([1, 2]),
    channels_first=st.booleans(),
    stride=st.sampled_from([1, 2]),
    padding=st.sampled_from(["SAME", "VALID"]),
    rhs_dilation=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    transposed=st.booleans(),
    size=st.sampled_from([1, 3]),
    num_microbatches=st.sampled_from([2, 4]),
)
def test_property_the_layout_changes_no_number(
    spatial,
    channels_first,
    stride,
    padding,
    rhs_dilation,
    groups,
    transposed,
    size,
    num_microbatches,
):
    """Over the convolution's options (a 1x1 kernel's gradient becomes a
    dot) the rewritten window equals the untouched window and the big batch
    (float64, 1e-12)."""
    with jax.enable_x64():
        lhs, rhs, out = _LAYOUTS[spatial]
        if channels_first:
            lhs = out = lhs[0] + lhs[-1] + lhs[1:-1]
        shape = (
            (8, *(7,) * spatial, 4) if not channels_first else (8, 4, *(7,) * spatial)
        )
        images = jax.random.normal(jax.random.key(0), shape, jnp.float64)
        in_channels = 4 if transposed else 4 // groups
        keys = jax.random.split(jax.random.key(1), 2)
        shape = (*(size,) * spatial, in_channels, 4)
        kernels = [jax.random.normal(key, shape, jnp.float64) / 4 for key in keys]

        options = dict(
            rhs_dilation=(rhs_dilation,) * spatial, dimension_numbers=(lhs, rhs, out)
        )

        def conv(images, kernel):
            strides = (stride,) * spatial
            if transposed:
                return lax.conv_transpose(images, kernel, strides, padding, **options)
            return lax.conv_general_dilated(
                images, kernel, strides, padding, feature_group_count=groups, **options
            )

        def loss(kernels, images):  # two layers: the input's gradient too
            hidden = jnp.tanh(conv(images, kernels[0]))
            return jnp.mean(jnp.tanh(conv(hidden, kernels[1])) ** 2)

        def step(layout):
            window = jaxaccum.value_and_grad(loss, num_microbatches, conv_layout=layout)
            return jax.jit(window)(kernels, images)

        rewritten, untouched = step("canonical"), step("traced")
        chex.assert_trees_all_close(rewritten, untouched, atol=FLOAT64_TOL, rtol=0)
        big = jax.value_and_grad(loss)(kernels, images)
        chex.assert_trees_all_close(rewritten, big, atol=FLOAT64_TOL, rtol=0)


@pytest.mark.parametrize("dn", [("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")])
def test_a_pointwise_kernels_gradient_is_a_dot_without_copies(dn):
    """A 1x1 convolution's kernel gradient (a contraction over the whole
    micro-batch) becomes a dot in the loop, not a convolution between
    transposed copies (untouched, it is the slow one); its numbers are the
    big batch's (float64, 1e-12)."""
    with jax.enable_x64():
        images = jax.random.normal(jax.random.key(0), (8, 4, 5, 5), jnp.float64)
        kernel = jax.random.normal(jax.random.key(1), (3, 4, 1, 1), jnp.float64)
        if dn[0] == "NHWC":
            images, kernel = images.transpose(0, 2, 3, 1), kernel.transpose(2, 3, 1, 0)

        def loss(kernel, images):
            out = lax.conv_general_dilated(
                images, kernel, (1, 1), "VALID", dimension_numbers=dn
            )
            return jnp.mean(jnp.tanh(out) ** 2)

        def step(layout):
            return jax.jit(jaxaccum.value_and_grad(loss, 4, conv_layout=layout))

        def loop_convolutions(layout):
            compiled = step(layout).lower(kernel, images).compile()
            return [c for c in find_convolutions(compiled) if c.in_loop]

        # XLA makes the 1x1 forward and input gradient dots itself.
        assert loop_convolutions("canonical") == []
        assert not all(c.canonical for c in loop_convolutions("traced"))
        chex.assert_trees_all_close(
            step("canonical")(kernel, images),
            jax.value_and_grad(loss)(kernel, images),
            atol=FLOAT64_TOL,
            rtol=0,
        )


@pytest.mark.parametrize("spatial", [1, 2])
def test_a_transposed_convolutions_kernel_gradient_has_no_reversed_window(spatial):
    """XLA swaps the operands of a transposed convolution's kernel gradient
    (its window outgrows its input) and reverses the window, which no fast
    CPU kernel takes; the window swaps them first, so its loop holds no
    reversed window (the untouched one does), and its numbers are the big
    batch's (float64, 1e-12)."""
    dn = _LAYOUTS[spatial]
    with jax.enable_x64():
        shape = (8, *(6,) * spatial, 3)
        images = jax.random.normal(jax.random.key(0), shape, jnp.float64)
        kernel = jax.random.normal(jax.random.key(1), (*(3,) * spatial, 3, 4)) / 4

        def loss(kernel, images):
            up = lax.conv_transpose(
                images, kernel, (2,) * spatial, "SAME", dimension_numbers=dn
            )
            return jnp.mean(jnp.tanh(up) ** 2)

        def step(layout):
            return jax.jit(jaxaccum.value_and_grad(loss, 4, conv_layout=layout))

        def reversed_window(layout):
            return (
                "rhs_reversal" in step(layout).lower(kernel, images).compile().as_text()
            )

        assert not reversed_window("canonical")
        assert reversed_window("traced")
        chex.assert_trees_all_close(
            step("canonical")(kernel, images),
            jax.value_and_grad(loss)(kernel, images),
            atol=FLOAT64_TOL,
            rtol=0,
        )


def test_python_arguments_stay_static_and_fun_is_traced_as_often():
    """The rewrite traces ``fun`` no more often than the untouched window
    (once per compilation, not per call) and passes Python arguments as
    they are (``if train:``)."""
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 4)) / 6
    traces = {}

    def counted(layout):
        def loss(kernel, images, train):
            traces[layout] = traces.get(layout, 0) + 1
            value = _conv_loss(kernel, images)
            return value * 2 if train else value

        return jax.jit(
            jaxaccum.value_and_grad(loss, 4, conv_layout=layout), static_argnums=2
        )

    for layout in ("auto", "traced"):
        step = counted(layout)
        value, _ = step(kernel, _images(), True)
        step(kernel, _images(), True)
        chex.assert_trees_all_close(value, 2 * _conv_loss(kernel, _images()))
    assert traces["auto"] == traces["traced"], traces


def test_a_bad_layout_is_refused():
    with pytest.raises(ValueError, match="conv_layout must be one of"):
        jaxaccum.value_and_grad(_conv_loss, 2, conv_layout="fast")


def test_plan_says_when_the_loop_runs_slow_convolutions():
    """plan's report names the convolutions left in XLA:CPU's slow layout in
    the chosen window's loop (none with the default)."""
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 4)) / 6
    for layout, slow in (("auto", False), ("traced", True)):
        memory = jaxaccum.plan(
            _conv_loss,
            kernel,
            _images(),
            memory_budget="1 GiB",
            candidates=[4],
            conv_layout=layout,
        )
        assert ("slow layout" in str(memory)) == slow, str(memory)
        assert bool(memory.rows[0].slow_loop_convolutions) == slow


def test_kernel_gradients_input_waits_for_its_cotangent():
    """``_conv_order``: each kernel gradient's transposed input is made in
    the backward pass, not beside its activation in the forward pass. The
    dependency survives XLA (a ``dynamic-update-slice`` per kernel gradient
    in the compiled program), the window's temporaries are no larger than
    the untouched window's, and the values are the untouched window's."""
    images = _images(batch=16, size=16, channels=8)
    keys = jax.random.split(jax.random.key(1), 3)
    kernels = [jax.random.normal(k, (3, 3, 8, 8)) / 8 for k in keys]

    def loss(kernels, images):
        dn = ("NHWC", "HWIO", "NHWC")
        h = images
        for kernel in kernels:
            h = jax.nn.relu(
                lax.conv_general_dilated(
                    h, kernel, (1, 1), "SAME", dimension_numbers=dn
                )
            )
        return jnp.mean(h**2)

    def compiled(layout):
        step = jaxaccum.value_and_grad(loss, 4, conv_layout=layout)
        return jax.jit(step).lower(kernels, images).compile()

    window, traced = compiled("canonical"), compiled("traced")
    # The first layer's input is the batch: it has no input gradient.
    assert window.as_text().count(" dynamic-update-slice(") == len(kernels) - 1
    temps = [c.memory_analysis().temp_size_in_bytes for c in (window, traced)]
    assert temps[0] <= temps[1]
    # float32: the sums' order differs (float64 within 1e-12: tested above).
    chex.assert_trees_all_close(
        window(kernels, images), traced(kernels, images), rtol=1e-4, atol=1e-7
    )
