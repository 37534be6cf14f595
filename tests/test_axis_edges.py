"""The window as a named axis at its edges (issue 72): ``axis_index_groups``,
the caller's own ``shard_map`` or ``vmap``, dtypes at the cuts (integer
collectives, bfloat16 parameters beside a float32 accumulator), Python
arguments that stay static, custom derivative rules, layer scans of length 0.

The contract is ``jax.vmap(fun, axis_name=...)`` over the N strided
micro-batches; ``vmap`` has no ``axis_index_groups``, so a grouped window's
reference is a ``vmap`` per group, nested (each group of micro-batches its
own axis, as ``pmap`` computes groups). Float64 within 1e-12, as in
tests/test_axis.py; a bfloat16 leaf within a few of its roundings.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axis_sharded_cases import data_parallel, nt_xent
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec

import jaxaccum

FLOAT64_TOL = 1e-12
BATCH = 16
AXIS = "window"
# bfloat16 keeps 8 significant bits: one rounding is within 2**-9 relative;
# the window and the reference round a handful of times in another order.
BFLOAT16_RTOL = 8 * 2.0**-9


def _problem(dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(3), 3)
    params = {
        "w": jax.random.normal(keys[0], (3, 4), dtype),
        "scale": jnp.asarray(1.5, dtype),
    }
    batch = jax.random.normal(keys[1], (BATCH, 3), dtype)
    return params, batch


def _errors(got, want):
    return jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, want)


def assert_close(got, want, tol=FLOAT64_TOL):
    worst = max(jax.tree.leaves(_errors(got, want)))
    assert worst <= tol, f"{worst:.3g} from the reference (tol {tol})"


def grouped_reference(loss, params, batch, num, groups, *rest):
    """The mean loss over the window and its gradient, each group of
    micro-batches a vmapped axis of its own (``groups`` None: one group)."""
    micro = jaxaccum.split_batch(batch, num)
    groups = [list(range(num))] if groups is None else groups
    ordered = micro[np.asarray(groups)]  # (groups, members, rows, ...)

    def window(params):
        member = jax.vmap(lambda b: loss(params, b, *rest), axis_name=AXIS)
        return jnp.mean(jax.vmap(member)(ordered))

    return jax.value_and_grad(window)(params)


def grouped_loss(params, batch, groups):
    """Every collective that takes groups, over the window's groups."""
    hidden = jnp.tanh(batch @ params["w"])
    mean = lax.pmean(jnp.mean(hidden, 0), AXIS, axis_index_groups=groups)
    top = lax.pmax(lax.stop_gradient(jnp.max(hidden)), AXIS, axis_index_groups=groups)
    rows = lax.all_gather(hidden, AXIS, axis_index_groups=groups, tiled=True)
    firsts = lax.all_gather(hidden[0], AXIS, axis_index_groups=groups, axis=1)
    count = lax.psum(1.0, AXIS, axis_index_groups=groups)
    return (
        jnp.mean((hidden - mean) ** 2)
        + top
        + jnp.mean(rows @ hidden.T) / count
        + jnp.sum(firsts**2) * params["scale"]
    )


@pytest.mark.parametrize(
    "groups", [[[0, 1], [2, 3]], [[0, 3], [1, 2]], [[0], [1], [2], [3]]]
)
def test_axis_index_groups_are_each_groups_window(groups):
    """Each group of micro-batches its own reduction, as pmap's groups."""
    with jax.enable_x64():
        params, batch = _problem()
        step = jaxaccum.value_and_grad(grouped_loss, 4, axis_name=AXIS)
        hashable = tuple(map(tuple, groups))
        got = jax.jit(step, static_argnums=2)(params, batch, hashable)
        want = grouped_reference(grouped_loss, params, batch, 4, groups, None)
        assert_close(got, want)


class _GroupedBatchNorm(nn.Module):
    groups: tuple | None = ((0, 1), (2, 3))

    @nn.compact
    def __call__(self, x):
        norm = nn.BatchNorm(
            use_running_average=False,
            axis_name=AXIS,
            axis_index_groups=self.groups,
            param_dtype=x.dtype,
            dtype=x.dtype,
        )
        return nn.Dense(1, param_dtype=x.dtype, dtype=x.dtype)(norm(x))[:, 0]


def test_flax_batchnorm_with_groups_is_the_grouped_window():
    """The issue's case: Flax BatchNorm with axis_index_groups at N = 4
    (the groups were dropped from the sum and kept in pmean's divisor)."""
    with jax.enable_x64():
        params, batch = _problem()
        variables = _GroupedBatchNorm(None).init(jax.random.key(0), batch[:4])
        variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables)

        def loss(params, batch, model=None):
            model = _GroupedBatchNorm() if model is None else model
            out, _ = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                batch,
                mutable=["batch_stats"],
            )
            return jnp.mean(out**2)

        step = jaxaccum.value_and_grad(loss, 4, axis_name=AXIS)
        got = jax.jit(step)(variables["params"], batch)
        grouped, per_group = variables["params"], _GroupedBatchNorm(None)
        want = grouped_reference(loss, grouped, batch, 4, [[0, 1], [2, 3]], per_group)
        assert_close(got, want)


def test_groups_that_do_not_split_the_window_are_refused():
    params, batch = _problem(jnp.float32)
    with pytest.raises(ValueError, match=r"axis_index_groups=\[\[0\]\].*4 members"):
        jaxaccum.value_and_grad(grouped_loss, 4, axis_name=AXIS)(params, batch, [[0]])
    uneven = [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="groups of one size"):
        jaxaccum.value_and_grad(grouped_loss, 4, axis_name=AXIS)(params, batch, uneven)

    def mixed(params, batch):
        hidden = batch @ params["w"]
        both = ("data", AXIS)
        return jnp.mean(lax.psum(hidden, both, axis_index_groups=[[0, 1]]))

    mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Explicit,))
    step = jaxaccum.shard_value_and_grad(mixed, 2, mesh=mesh, axis_name=AXIS)
    with pytest.raises(TypeError, match="groups are computed over the window's"):
        step(params, batch)


def _bn_loss(axes):
    def loss(params, batch):
        hidden = batch @ params["w"]
        mean = lax.pmean(jnp.mean(hidden, 0), axes)
        return jnp.mean((hidden - mean) ** 2)

    return loss


def _one_device_mesh():
    return jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Auto,))


def test_an_axis_the_caller_binds_is_refused_by_name():
    """axis_name='data' inside the caller's shard_map over 'data' (or vmap)
    would shadow the devices: refused, naming the bound axis."""
    params, batch = _problem(jnp.float32)
    step = jaxaccum.value_and_grad(_bn_loss("data"), 2, axis_name="data")
    specs = (PartitionSpec(), PartitionSpec("data"))
    for check_vma in (True, False):
        mapped = jax.shard_map(
            step,
            mesh=_one_device_mesh(),
            in_specs=specs,
            out_specs=PartitionSpec(),
            check_vma=check_vma,
        )
        with pytest.raises(ValueError, match="'data' is already bound .* 1 members"):
            mapped(params, batch)
    stacked = jnp.stack([batch, batch])
    with pytest.raises(ValueError, match="'data' is already bound .* 2 members"):
        jax.vmap(step, in_axes=(None, 0), axis_name="data")(params, stacked)


def test_a_window_inside_the_callers_shard_map():
    """With varying-axis types (check_vma=True, the default) JAX's
    collectives take only the mesh's axes: refused, naming the paths that
    work; without them, the window over ('data', 'window') is the big
    batch's."""
    with jax.enable_x64():
        params, batch = _problem()
        both = _bn_loss(("data", AXIS))
        step = jaxaccum.value_and_grad(both, 4, axis_name=AXIS)
        specs = (PartitionSpec(), PartitionSpec("data"))
        mesh = _one_device_mesh()
        typed = jax.shard_map(
            step, mesh=mesh, in_specs=specs, out_specs=PartitionSpec()
        )
        with pytest.raises(TypeError, match="check_vma=True.*shard_value_and_grad"):
            typed(params, batch)
        untyped = jax.shard_map(
            step,
            mesh=mesh,
            in_specs=specs,
            out_specs=PartitionSpec(),
            check_vma=False,
        )
        want = grouped_reference(_bn_loss(AXIS), params, batch, 1, None)
        assert_close(jax.jit(untyped)(params, batch), want)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.int64])
def test_an_integer_collective_keeps_its_dtype(dtype):
    """A token count psum'd over the window and guarded by jnp.maximum
    (lax.max takes one dtype): the count keeps its operand's dtype."""
    with jax.enable_x64():
        params, batch = _problem()

        def loss(params, batch):
            hidden = batch @ params["w"]
            kept = jnp.sum(hidden[:, 0] > 0).astype(dtype)
            count = lax.max(lax.psum(kept, AXIS), jnp.ones((), dtype))
            top = lax.pmax(kept, AXIS)
            assert count.dtype == dtype and top.dtype == dtype
            return jnp.sum(hidden**2) / count + top

        got = jax.jit(jaxaccum.value_and_grad(loss, 4, axis_name=AXIS))(params, batch)
        assert_close(got, grouped_reference(loss, params, batch, 4, None))


def test_bfloat16_parameters_at_the_cuts_keep_their_dtype():
    """bfloat16 parameters with accum_dtype=float32: a collective that reads
    a parameter, and an aux that returns one, see bfloat16 (the window's
    float32 accumulation copy stays inside it)."""
    params, batch = _problem(jnp.float32)
    params = {
        "w": params["w"].astype(jnp.bfloat16),
        "scale": params["scale"].astype(jnp.bfloat16),
        "centers": jnp.ones((2, 4), jnp.bfloat16),
    }

    def loss(params, batch):
        hidden = batch.astype(jnp.bfloat16) @ params["w"]
        scale = lax.pmean(params["scale"], AXIS)
        centers = lax.all_gather(params["centers"], AXIS)[0]
        mean = lax.pmean(jnp.mean(hidden, 0), AXIS)
        out = (hidden - mean) / scale + centers[0]
        return jnp.mean(out**2), params["scale"]

    step = jaxaccum.value_and_grad(
        loss, 4, axis_name=AXIS, has_aux=True, accum_dtype=jnp.float32
    )
    (value, aux), grads = jax.jit(step)(params, batch)
    assert value.dtype == aux.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(aux, params["scale"])
    chex.assert_trees_all_equal_dtypes(grads, params)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), params)

    def reference(params, batch):
        return loss(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), batch)[0]

    want_value, want = grouped_reference(reference, wide, batch, 4, None)
    for name, grad in grads.items():
        bound = BFLOAT16_RTOL * float(jnp.max(jnp.abs(want[name])))
        assert_close(grad.astype(jnp.float32), want[name], bound)
    assert_close(value.astype(jnp.float32), want_value, BFLOAT16_RTOL * want_value)


def _static_loss(params, batch, train, num_classes=3, *, center=True):
    """Python arguments used as Python values: a branch, a shape."""
    hidden = batch @ params["w"]
    if train and center:
        hidden = hidden - lax.pmean(jnp.mean(hidden, 0), AXIS)
    labels = jax.nn.one_hot(jnp.arange(batch.shape[0]) % num_classes, num_classes)
    return jnp.mean(hidden**2) + jnp.mean(labels @ jnp.ones((num_classes, 4)) * hidden)


def test_python_arguments_stay_static():
    """train=True, num_classes=3, center=True: eager, and under jax.jit with
    static_argnums / static_argnames, as the plain window and vmap keep them."""
    with jax.enable_x64():
        params, batch = _problem()
        step = jaxaccum.value_and_grad(_static_loss, 4, axis_name=AXIS)
        for train in (True, False):
            want = grouped_reference(_static_loss, params, batch, 4, None, train, 3)
            assert_close(step(params, batch, train, 3, center=True), want)
            jitted = jax.jit(step, static_argnums=(2, 3), static_argnames="center")
            assert_close(jitted(params, batch, train, 3, center=True), want)


@jax.custom_jvp
def _jvp_coupled(x):
    return 2.0 * x


@_jvp_coupled.defjvp
def _jvp_coupled_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return _jvp_coupled(x), lax.psum(t, AXIS)


@jax.custom_vjp
def _vjp_coupled(x):
    return 2.0 * x


_vjp_coupled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (lax.psum(g, AXIS),))


@pytest.mark.parametrize("custom", [_jvp_coupled, _vjp_coupled], ids=["jvp", "vjp"])
@pytest.mark.parametrize("primal_cut", [True, False])
def test_a_collective_in_a_derivative_rule_is_refused_by_name(custom, primal_cut):
    params, batch = _problem(jnp.float32)

    def loss(params, batch):
        hidden = batch @ params["w"]
        if primal_cut:
            hidden = hidden - lax.pmean(jnp.mean(hidden), AXIS)
        return jnp.mean(custom(hidden))

    step = jaxaccum.value_and_grad(loss, 2, axis_name=AXIS)
    with pytest.raises(TypeError, match="derivative rule of a jax.custom_"):
        step(params, batch)


def _layer_scan_loss(length):
    def loss(params, batch):
        def layer(hidden, _):
            hidden = jnp.tanh(hidden @ params["w"].T @ params["w"])
            return hidden - lax.pmean(jnp.mean(hidden, 0), AXIS), jnp.sum(hidden)

        hidden, sums = lax.scan(layer, batch @ params["w"], None, length=length)
        return jnp.mean(hidden**2) + jnp.sum(sums) * params["scale"]

    return loss


@pytest.mark.parametrize("length", [0, 2])
def test_a_layer_scan_of_any_length(length):
    """A layer scan holding a collective, of length 0 (its ys empty, its
    carry unchanged, as vmap gives them) and 2."""
    with jax.enable_x64():
        params, batch = _problem()
        loss = _layer_scan_loss(length)
        got = jax.jit(jaxaccum.value_and_grad(loss, 4, axis_name=AXIS))(params, batch)
        assert_close(got, grouped_reference(loss, params, batch, 4, None))


def _edge_loss(params, batch, train, groups, count_dtype, length):
    """The edges at once: a static flag, grouped statistics, an integer
    count, a bfloat16-stored parameter read by a collective, a layer scan."""
    hidden = batch @ params["w"]
    if train:
        mean = lax.pmean(jnp.mean(hidden, 0), AXIS, axis_index_groups=groups)
        hidden = hidden - mean
    kept = jnp.sum(hidden[:, 0] > 0).astype(count_dtype)
    count = lax.psum(kept, AXIS, axis_index_groups=groups)
    count = lax.max(count, jnp.ones((), count_dtype))
    scale = lax.pmean(params["scale"], AXIS, axis_index_groups=groups)
    scale = scale.astype(hidden.dtype)
    hidden = _layer_scan_loss(length)({"w": params["w"], "scale": 0.0}, batch) + hidden
    return jnp.sum(hidden**2) * scale / count


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    num=st.sampled_from([2, 4]),
    grouped=st.booleans(),
    train=st.booleans(),
    count_dtype=st.sampled_from([jnp.int8, jnp.int32]),
    length=st.sampled_from([0, 1]),
    bfloat16_scale=st.booleans(),
)
def test_property_the_edges_are_the_vmapped_window(
    num, grouped, train, count_dtype, length, bfloat16_scale
):
    """Over the edges' options together, the window equals the (grouped)
    vmapped window: float64 within 1e-12, the bfloat16 scale's gradient
    within its roundings."""
    with jax.enable_x64():
        params, batch = _problem()
        if bfloat16_scale:
            params["scale"] = params["scale"].astype(jnp.bfloat16)
        groups = [list(range(0, num, 2)), list(range(1, num, 2))] if grouped else None
        step = jaxaccum.value_and_grad(
            _edge_loss, num, axis_name=AXIS, accum_dtype=jnp.float32
        )
        static = (2, 3, 4, 5)
        hashable = None if groups is None else tuple(map(tuple, groups))
        args = (train, hashable, count_dtype, length)
        value, grads = jax.jit(step, static_argnums=static)(params, batch, *args)
        ungrouped = (train, None, count_dtype, length)  # each group its vmap
        want_value, want = grouped_reference(
            _edge_loss, params, batch, num, groups, *ungrouped
        )
        assert_close(value, want_value)
        assert_close(grads["w"], want["w"])
        assert grads["scale"].dtype == params["scale"].dtype
        tol = BFLOAT16_RTOL if bfloat16_scale else FLOAT64_TOL
        bound = tol * max(1.0, abs(float(want["scale"])))
        assert_close(grads["scale"].astype(jnp.float64), want["scale"], bound)


def _two_view_problem():
    """SimCLR's batch as data parallelism lays it out for 4 devices: each
    block of 4 rows holds 2 examples' two views."""
    params, batch = _problem()
    params = {"image": params["w"]}
    views = batch.reshape(4, 2, 2, 3)  # (device, view, example, features)
    noisy = views.at[:, 1].add(0.1 * jnp.sin(views[:, 0]))
    return params, noisy.reshape(BATCH, 3)


def test_contiguous_layout_runs_data_parallel_code_unedited():
    """The issue's SimCLR: its NT-Xent pairs rows within a device's slice.
    With axis_layout='contiguous' the window's members are the data-parallel
    devices' slices (float64, 1e-12); the default strided members pair the
    wrong rows, silently far off."""
    with jax.enable_x64():
        params, batch = _two_view_problem()
        want = data_parallel(nt_xent, params, batch, 4)
        contiguous = jaxaccum.value_and_grad(
            nt_xent, 4, axis_name=AXIS, axis_layout="contiguous"
        )
        assert_close(jax.jit(contiguous)(params, batch), want)
        strided = jaxaccum.value_and_grad(nt_xent, 4, axis_name=AXIS)
        value, _ = jax.jit(strided)(params, batch)
        assert abs(float(value - want[0])) > 1e-2, (float(value), float(want[0]))
        mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Explicit,))
        per_device = jaxaccum.shard_value_and_grad(
            nt_xent, 4, mesh=mesh, axis_name=AXIS, axis_layout="contiguous"
        )
        assert_close(jax.jit(per_device)(params, batch), want)


def test_contiguous_layout_concatenates_rows_in_batch_order():
    with jax.enable_x64():
        params, batch = _two_view_problem()

        def loss(params, batch):
            rows = jnp.tanh(batch @ params["image"])
            centered = rows - lax.pmean(jnp.mean(rows, 0), AXIS)
            return jnp.mean(centered**2), centered[:, 0]

        step = jaxaccum.value_and_grad(
            loss,
            4,
            axis_name=AXIS,
            axis_layout="contiguous",
            has_aux=True,
            aux_reduction="concat",
        )
        (_, rows), _ = jax.jit(step)(params, batch)
        whole = jnp.tanh(batch @ params["image"])
        assert_close(rows, (whole - jnp.mean(whole, 0))[:, 0])


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="axis_layout must be one of"):
        jaxaccum.value_and_grad(nt_xent, 2, axis_name=AXIS, axis_layout="blocks")
    with pytest.raises(ValueError, match="axis_layout='contiguous' without axis_name"):
        jaxaccum.value_and_grad(nt_xent, 2, axis_layout="contiguous")
