"""A type checker reads every public entry point's keywords.

mypy runs (once, over two small files) on calls a user could write: each
misspelt or mistyped keyword is flagged on its own line, and nothing is
flagged on the right calls. The run-time refusals are tested with the front
ends (tests/test_layout.py); this is what an editor shows before running.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

_PRELUDE = """\
import jax
import jax.numpy as jnp
import optax

import jaxaccum as acc
from jaxaccum import equinox as eqx_acc
from jaxaccum import flax as flax_acc
from jaxaccum import losses, testing


def loss(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.mean(x @ w)


w, x = jnp.ones(3), jnp.ones((8, 3))
params = (w, jnp.ones((2, 3, 3)), w)
mesh = jax.make_mesh((1,), ("data",))
budget = "1GiB"
"""

# One call per line, each with one mistake a user makes: a misspelt keyword,
# a value of the wrong type, an option the front end does not take.
WRONG = [
    'acc.value_and_grad(loss, 4, reductio="sum")',
    'acc.value_and_grad(loss, 4, remat="yes")',
    'acc.grad(loss, 4, reduction="median")',
    "acc.grad(loss, 4, param_gather='window')",
    'acc.shard_value_and_grad(loss, 4, mesh=mesh, grad_reduce="always")',
    "acc.shard_value_and_grad(loss, 4, mesh=mesh, masked=True)",
    'acc.pipeline_value_and_grad(loss, loss, 4, mesh=mesh, schedule="zb")',
    "acc.pipeline_value_and_grad(loss, loss, 4, mesh=mesh, pad=True)",
    "acc.plan(loss, w, x, memory_budget=budget, acum_dtype=None)",
    "acc.plan(loss, w, x, memory_budget=budget, masked=True)",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, pad=1.5)",
    'acc.plan_pipeline(loss, loss, params, x, memory_budget=budget, remat="no")',
    'flax_acc.linen_value_and_grad(loss, 2, reduction="avg")',
    "flax_acc.linen_train_step(loss, 2, argnums=1)",
    "flax_acc.nnx_value_and_grad(loss, 2, key_argnums=1)",
    "flax_acc.linen_diagnose(loss, w, x, num_microbatches=2, loss_scale=True)",
    "flax_acc.nnx_diagnose(loss, w, x, num_microbatches=2, has_aux=1.0)",
    "eqx_acc.filter_value_and_grad(loss, 2, argnums=1)",
    'eqx_acc.filter_grad(loss, 2, has_aux="yes")',
    'eqx_acc.filter_assert_grads_match_full_batch(loss, w, x, unroll="2")',
    "eqx_acc.filter_diagnose(loss, w, x, report_stat=True)",
    "testing.assert_grads_match_full_batch(loss, w, x, accum_dtype=3.5)",
    "testing.diagnose(loss, w, x, batch_argnums=1.0)",
    'acc.cached_value_and_grad(loss, loss, 4, reduction="sum")',
    "acc.cached_value_and_grad(loss, loss, 4, acum_dtype=None)",
    "acc.cached_value_and_grad(loss, loss, 4, state_argnums=2)",
    "acc.cached_value_and_grad(loss, loss, 4, data_axis=3)",
    "losses.softmax_contrastive(x, x, 10.0, blocksize=4)",
    'losses.sigmoid_contrastive(x, x, 10.0, -10.0, block_size="4")',
]

RIGHT = [
    "acc.value_and_grad(loss, 4, reduction='sum', accum_dtype=jnp.bfloat16)",
    "acc.value_and_grad(loss, microbatch_size=2, remat=True, argnums=(0,))",
    "acc.value_and_grad(loss, 4, remat=jax.checkpoint_policies.dots_saveable)",
    "acc.value_and_grad(loss, 4, has_aux=True, aux_reduction={'a': 'stack'})",
    "acc.value_and_grad(loss, 4, pad=True, reduction='weighted', masked=True)",
    "acc.grad(loss, 4, accum_dtype=None, loss_scale=True, unroll=2)",
    "acc.shard_value_and_grad(loss, 4, mesh=mesh, grad_reduce='window')",
    "acc.shard_value_and_grad(loss, 4, data_axis=('data',), gather_dtype=None)",
    "acc.pipeline_value_and_grad(loss, loss, 4, mesh=mesh, schedule='1f1b')",
    "acc.pipeline_value_and_grad(loss, loss, 4, report_finite=True)",
    "acc.plan(loss, w, x, memory_budget=budget, optimizer=optax.sgd(0.1))",
    "acc.plan(loss, w, x, memory_budget=1 << 30, reduction='sum')",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, pad=True)",
    "acc.plan_pipeline(loss, loss, params, x, memory_budget=budget, remat=True)",
    "acc.plan_pipeline(loss, loss, params, x, memory_budget=1, schedule='gpipe')",
    "flax_acc.linen_value_and_grad(loss, 2, mutable='batch_stats', has_aux=True)",
    "flax_acc.linen_train_step(loss, 2, report_stats=True)",
    "flax_acc.nnx_value_and_grad(loss, 2, loss_scale=True)",
    "flax_acc.linen_diagnose(loss, w, x, num_microbatches=2, has_aux=True)",
    "flax_acc.nnx_diagnose(loss, w, x, num_microbatches=2, reduction='sum')",
    "eqx_acc.filter_value_and_grad(loss, 2, batch_argnums=(1, 2))",
    "eqx_acc.filter_grad(loss, 2, has_aux=True, state_argnums=2)",
    "eqx_acc.filter_assert_grads_match_full_batch(loss, w, x, rtol=1e-4)",
    "eqx_acc.filter_diagnose(loss, w, x, num_microbatches=2, masked=True)",
    "testing.assert_grads_match_full_batch(loss, w, x, accum_dtype='float32')",
    "testing.diagnose(loss, w, x, num_microbatches=2, argnums=0)",
    "acc.cached_value_and_grad(loss, loss, 4, key_argnums=2, accum_dtype=None)",
    "acc.cached_value_and_grad(loss, loss, microbatch_size=2, argnums=(0, 2))",
    "acc.cached_value_and_grad(loss, loss, 2, has_aux=True, unroll=True)",
    "acc.cached_value_and_grad(loss, loss, 2, mesh=mesh, data_axis=('data',))",
    "losses.softmax_contrastive(x, x, jnp.exp(jnp.log(10.0)), block_size=4)",
    "losses.sigmoid_contrastive(x, x, 10.0, -10.0, block_size=2)",
]


def _line_numbers(calls: list[str]) -> dict[int, str]:
    """Each call's line in the file :func:`_write` writes."""
    first = _PRELUDE.count("\n") + 1
    return {first + index: call for index, call in enumerate(calls)}


def _write(path: pathlib.Path, calls: list[str]) -> None:
    """Writes the prelude and ``calls``, one a line."""
    path.write_text(_PRELUDE + "\n".join(calls) + "\n")


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """mypy's errors on the wrong and the right calls (one run over both
    files, jaxaccum read from this source tree): line numbers by file, and
    mypy's output."""
    pytest.importorskip("mypy")
    folder = tmp_path_factory.mktemp("typing")
    files = {"wrong": folder / "wrong.py", "right": folder / "right.py"}
    _write(files["wrong"], WRONG)
    _write(files["right"], RIGHT)
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(folder / "cache"),
        "--follow-imports=silent",
        "--no-error-summary",
        "--no-pretty",
        *(str(path) for path in files.values()),
    ]
    env = {"MYPYPATH": str(ROOT), "HOME": str(folder)}
    result = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    errors: dict[str, list[int]] = {"wrong": [], "right": []}
    for line in result.stdout.splitlines():
        match = re.match(r"(.*?):(\d+): error: ", line)
        if match:
            errors[pathlib.Path(match[1]).stem].append(int(match[2]))
    return errors, result.stdout


def test_mypy_flags_every_misspelt_or_mistyped_keyword(mypy_run):
    errors, output = mypy_run
    lines = _line_numbers(WRONG)
    missed = [call for line, call in lines.items() if line not in errors["wrong"]]
    assert not missed, (
        f"mypy flags {len(lines) - len(missed)} of {len(lines)} wrong calls; "
        f"not:\n" + "\n".join(missed) + f"\n{output}"
    )
    assert sorted(errors["wrong"]) == sorted(lines), f"not one error a call:\n{output}"


def test_mypy_flags_nothing_on_right_calls(mypy_run):
    errors, output = mypy_run
    assert not errors["right"], f"{len(errors['right'])} error(s):\n{output}"
