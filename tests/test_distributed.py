"""Data parallel accumulation: sharded batches, deferred all-reduce, multi-host.

The multi-device checks need more devices than this process has, so they run
in subprocesses: ``distributed_checks.py`` on 8 forced CPU devices (one process
for all its checks), and ``multiprocess_worker.py`` as 2 processes x 2 devices
talking over 127.0.0.1. Tolerances (float32): RTOL, ATOL (tests/tolerances.py)
against the single-device full-batch gradient.
"""

import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from check_scripts import TESTS, device_env, run_script, selected_checks
from distributed_checks import CHECKS
from models import classification_batch, mlp_loss, mlp_loss_with_aux, mlp_params
from tolerances import ATOL, RTOL

import jaxaccum

# Float32 rounding bounds, derived in tests/tolerances.py.


@pytest.fixture(scope="module")
def eight_devices(request) -> dict:
    """Runs the session's 8-device checks in one subprocess; their results."""
    checks = selected_checks(request)
    return run_script(
        "distributed_checks.py", num_devices=8, timeout=300, checks=checks
    )


@pytest.mark.parametrize("check", CHECKS)
def test_on_eight_devices(eight_devices, check):
    result = eight_devices[check]
    assert result["ok"], result["detail"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_single_process_full_batch(tmp_path):
    """2 processes x 2 CPU devices, each feeding its own rows, over 127.0.0.1;
    replicated parameters, then FSDP ones (sharded over the 4 devices)."""
    from multiprocess_worker import problem

    port, num_processes = _free_port(), 2
    outputs = [tmp_path / f"process{i}.npz" for i in range(num_processes)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(TESTS / "multiprocess_worker.py"),
                str(port),
                str(i),
                str(num_processes),
                str(outputs[i]),
            ],
            env=device_env(2),
            cwd=TESTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    try:
        logs = [process.communicate(timeout=240)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for i, (process, log) in enumerate(zip(processes, logs, strict=True)):
        assert process.returncode == 0, f"process {i} failed:\n{log[-4000:]}"

    params, batch = problem()
    value, grads = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    expected = {"value": value}
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        expected[f"grads{jax.tree_util.keystr(path)}"] = grad
    for i, output in enumerate(outputs):
        with np.load(output) as results:
            assert int(results["device_count"]) == 4
            # FSDP gradients come back sharded like their parameters.
            assert str(results["fsdp/spec[0]['w']"]) == "P(None, 'data')"
            assert str(results["fsdp/spec[1]['w']"]) == "P('data', None)"
            for mode in ("deferred", "per_microbatch", "fsdp"):
                actual = {key: results[f"{mode}/{key}"] for key in expected}
                try:
                    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
                except AssertionError as error:
                    raise AssertionError(f"process {i}, {mode}: {error}") from None


# Single-device behaviour (this process): a 1-device mesh is a valid mesh.


@pytest.fixture(scope="module")
def mlp():
    return mlp_params(jax.random.key(0)), classification_batch(jax.random.key(1), 16)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((1,), ("data",))


def test_one_device_mesh_equals_value_and_grad(mlp, mesh):
    params, batch = mlp
    expected = jax.jit(jaxaccum.value_and_grad(mlp_loss_with_aux, 4, has_aux=True))(
        params, batch
    )
    actual = jax.jit(
        jaxaccum.shard_value_and_grad(mlp_loss_with_aux, 4, mesh=mesh, has_aux=True)
    )(params, jaxaccum.shard_batch(batch, mesh))
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)


def test_mesh_from_context_microbatch_size_and_eager_call(mlp, mesh):
    params, batch = mlp
    expected = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    with jax.set_mesh(mesh):
        # Eager, with a batch not on the mesh yet: it is resharded.
        actual = jaxaccum.shard_value_and_grad(mlp_loss, microbatch_size=4)(
            params, batch
        )
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)


def test_no_mesh_is_a_clear_error(mlp):
    with pytest.raises(ValueError, match="No mesh: pass mesh="):
        jaxaccum.shard_value_and_grad(mlp_loss, 2)(*mlp)


def test_unknown_data_axis_is_named(mlp, mesh):
    with pytest.raises(ValueError, match=r"data_axis \['batch'\] not in the mesh"):
        jaxaccum.shard_value_and_grad(mlp_loss, 2, mesh=mesh, data_axis="batch")(*mlp)


def test_rows_per_device_must_split(mlp):
    mesh = jax.make_mesh((1,), ("data",))
    params, batch = mlp
    with pytest.raises(ValueError, match=r"16 rows per device.*\[1, 2, 4, 8, 16\]"):
        jaxaccum.shard_value_and_grad(mlp_loss, 3, mesh=mesh)(params, batch)


def test_per_device_aux_reductions_are_refused(mlp, mesh):
    fun = jaxaccum.shard_value_and_grad(
        mlp_loss_with_aux, 2, mesh=mesh, has_aux=True, aux_reduction="stack"
    )
    with pytest.raises(ValueError, match=r"\['stack'\] is not supported"):
        fun(*mlp)


@pytest.mark.parametrize("given", ["data", "devices", 3])
def test_a_mesh_that_is_not_one_is_refused_by_name(given):
    """A string, a list of devices or an int as mesh= (an AttributeError from
    inside before): a TypeError naming what was passed and what to pass."""
    bad = jax.devices() if given == "devices" else given
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh") as info:
        jaxaccum.shard_value_and_grad(mlp_loss, 2, mesh=bad)
    assert f"of type {type(bad).__name__}" in str(info.value), info.value
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jaxaccum.shard_batch({"x": np.ones((8, 3))}, bad)


def test_an_abstract_mesh_runs_where_it_is_set(mlp, mesh):
    """mesh=mesh.abstract_mesh: the big batch's inside jax.set_mesh(mesh);
    outside it (where it names no devices), refused, saying what to pass."""
    params, batch = mlp
    step = jaxaccum.shard_value_and_grad(mlp_loss, 2, mesh=mesh.abstract_mesh)
    with jax.set_mesh(mesh):
        actual = step(params, batch)
    expected = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="not the one set with jax.set_mesh"):
        step(params, batch)


@pytest.mark.parametrize("with_mesh", [True, False])
def test_data_axes_slip_is_an_unknown_keyword_with_a_hint(mesh, with_mesh):
    """data_axes= (for data_axis=), with mesh= or without: the unknown
    keyword's message, suggesting data_axis (a sentence about layouts before)."""
    options = {"mesh": mesh} if with_mesh else {}
    with pytest.raises(
        TypeError,
        match=r"unknown keyword argument 'data_axes' \(did you mean 'data_axis'\?\)",
    ):
        jaxaccum.shard_value_and_grad(mlp_loss, 2, data_axes="data", **options)


def test_options_are_checked_at_construction():
    with pytest.raises(ValueError, match="exactly one of num_microbatches"):
        jaxaccum.shard_value_and_grad(mlp_loss)
    with pytest.raises(TypeError, match="data_axis must be a mesh axis name"):
        jaxaccum.shard_value_and_grad(mlp_loss, 2, data_axis=3)


HLO = """\
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %all-reduce.1 = f32[4]{0} all-reduce(%x), to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %all-reduce.1)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %while.1 = (s32[], f32[4]) while(%init), condition=%cond, body=%body
  %all-reduce.2 = (f32[], f32[4]{0}) all-reduce(%a, %b), to_apply=%add
  ROOT %all-to-all.3 = f32[4]{0} all-to-all(%c), dimensions={0}
}
"""


def test_count_collectives_separates_loop_from_the_rest():
    counts = jaxaccum.testing.count_collectives(HLO)
    assert counts["all-reduce"] == {"loop": 1, "outside": 1}, counts
    assert counts["all-to-all"] == {"loop": 0, "outside": 1}, counts
    assert counts["collective-permute"] == {"loop": 0, "outside": 0}, counts


def test_shard_batch_single_process(mesh):
    batch = jaxaccum.shard_batch({"x": np.arange(6.0).reshape(3, 2)}, mesh)
    np.testing.assert_array_equal(batch["x"], np.arange(6.0).reshape(3, 2))
    assert batch["x"].sharding.spec == jax.P("data")
    assert isinstance(batch["x"], jax.Array) and batch["x"].dtype == jnp.float32
