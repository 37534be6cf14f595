"""cached_value_and_grad on a batch sharded over devices: under plain jit,
and per device with mesh= and data_axis= (tests/cached_checks.py, run on 8
host devices in its own process), and what the window per device refuses."""

import chex
import jax
import pytest
from cached_checks import CHECKS, MESH_ARGUMENT
from cached_models import big_batch, clip_loss, encode, towers
from check_scripts import run_script, selected_checks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import ATOL, RTOL  # float32 rounding bounds, derived there

import jaxaccum

PER_DEVICE = [check for check in CHECKS if check.startswith("mesh_")]
PLAIN_JIT = [check for check in CHECKS if check not in PER_DEVICE + MESH_ARGUMENT]


@pytest.fixture(scope="module")
def sharded_results(request) -> dict:
    checks = selected_checks(request)
    return run_script("cached_checks.py", num_devices=8, timeout=600, checks=checks)


@pytest.mark.parametrize("check", PLAIN_JIT)
def test_data_sharded_batch_under_plain_jit(sharded_results, check):
    """A batch sharded over 8 devices (Auto and Explicit meshes), plain jit:
    the big batch's value and gradient (tests/cached_checks.py)."""
    assert sharded_results[check]["ok"], sharded_results[check]["detail"]


@pytest.mark.parametrize("check", PER_DEVICE)
def test_window_per_device_is_exact_with_one_reduction_after_the_loops(
    sharded_results, check
):
    """mesh= and data_axis= over 8 devices (Auto, Explicit, a 2 x 4 mesh), N
    = 1, 2, 4: the big batch's value and gradient with a loss that sees the
    rows' order, and in the compiled program no collective inside a loop,
    one all-gather of the outputs and one all-reduce of the gradients;
    key_argnums' keys folded with the device's index, pass 2 drawing pass
    1's masks (mesh_keys_n2)."""
    assert sharded_results[check]["ok"], sharded_results[check]["detail"]


@pytest.mark.parametrize("check", MESH_ARGUMENT)
def test_window_per_device_where_the_mesh_comes_from(sharded_results, check):
    """mesh= on a 2-D Explicit mesh outside jax.set_mesh (eager and jit) and
    inside the caller's own shard_map manual over the data axis (the rows
    each device is given), and a property test over the window's options
    (N, microbatch_size, 1-D and 2-D meshes, has_aux, key_argnums, float32,
    bfloat16 and integer outputs): the big batch's (tests/mesh_cases.py,
    tests/cached_mesh_property.py)."""
    assert sharded_results[check]["ok"], sharded_results[check]["detail"]


def test_window_per_device_refuses_what_it_cannot_run():
    """A data axis not in the mesh, no mesh, a batch the devices' micro-batches
    do not split, FSDP parameters and the sharding modes: each refused, named."""
    params, batch = towers()
    mesh = jax.make_mesh((1,), ("data",))

    def cached(*, num=2, **options):
        return jaxaccum.cached_value_and_grad(encode, clip_loss, num, **options)

    with pytest.raises(ValueError, match=r"data_axis \['batch'\] not in the mesh"):
        cached(mesh=mesh, data_axis="batch")
    with pytest.raises(TypeError, match="data_axis must be a mesh axis name"):
        cached(mesh=mesh, data_axis=3)
    with pytest.raises(ValueError, match="No mesh: pass mesh="):
        cached(data_axis="data")(params, batch)
    with pytest.raises(ValueError, match="num_microbatches=3 does not divide") as info:
        cached(num=3, mesh=mesh)(params, batch)
    assert "pad=True" not in str(info.value), info.value  # pad is refused here
    with pytest.raises(TypeError, match="does not take param_gather"):
        cached(mesh=mesh, param_gather="window")
    first = jax.device_put(params["image"][0], NamedSharding(mesh, P("data")))
    fsdp = {**params, "image": (first, params["image"][1])}
    with pytest.raises(
        ValueError,
        match=r"args\[0\]\['image'\]\[0\] of shape \(6, 8\) is sharded "
        r"P\('data', None\) over the data axes \('data',\) \(FSDP\)",
    ):
        cached(mesh=mesh)(fsdp, batch)


@pytest.mark.parametrize("given", ["data", "devices", 3])
def test_a_mesh_that_is_not_one_is_refused_by_name(given):
    """A string, a list of devices or an int as mesh= (an AttributeError from
    inside before): a TypeError naming what was passed and what to pass."""
    bad = jax.devices() if given == "devices" else given
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh") as info:
        jaxaccum.cached_value_and_grad(encode, clip_loss, 2, mesh=bad)
    assert f"of type {type(bad).__name__}" in str(info.value), info.value


def test_an_abstract_mesh_runs_where_it_is_set():
    """mesh=mesh.abstract_mesh: the big batch's inside jax.set_mesh(mesh);
    outside it (where it names no devices), refused, saying what to pass."""
    params, batch = towers()
    mesh = jax.make_mesh((1,), ("data",))
    step = jaxaccum.cached_value_and_grad(encode, clip_loss, 2, mesh=mesh.abstract_mesh)
    with jax.set_mesh(mesh):
        actual = step(params, batch)
    chex.assert_trees_all_close(
        actual, big_batch(encode, clip_loss)(params, batch), rtol=RTOL, atol=ATOL
    )
    with pytest.raises(ValueError, match="not the one set with jax.set_mesh"):
        step(params, batch)


@pytest.mark.parametrize("with_mesh", [True, False])
def test_data_axes_slip_is_an_unknown_keyword_with_a_hint(with_mesh):
    """data_axes= (for data_axis=), with mesh= or without: the unknown
    keyword's message, suggesting data_axis (a sentence about layouts before)."""
    options = {"mesh": jax.make_mesh((1,), ("data",))} if with_mesh else {}
    with pytest.raises(
        TypeError,
        match=r"unknown keyword argument 'data_axes' \(did you mean 'data_axis'\?\)",
    ):
        jaxaccum.cached_value_and_grad(
            encode, clip_loss, 2, data_axes="data", **options
        )
