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
    # Options that type-checked but always failed at run time (issue 62).
    'acc.pipeline_value_and_grad(loss, loss, 4, param_gather="microbatch")',
    'acc.pipeline_value_and_grad(loss, loss, 4, grad_reduce="microbatch")',
    "acc.plan_pipeline(loss, loss, params, x, memory_budget=1, "
    "grad_reduce='microbatch')",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, "
    "microbatch_size=2)",
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
    "acc.value_and_grad(loss, 4, axis_nme='window')",
    "flax_acc.linen_value_and_grad(loss, 2, axis_name=['window'])",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, axis_nme='w')",
    "acc.MultiSteps(optax.sgd(0.1), 2, axis_name='window')",
    "acc.accumulate(optax.sgd(0.1), 2, axis_name='window')",
    "losses.softmax_contrastive(x, x, 10.0, blocksize=4)",
    'losses.sigmoid_contrastive(x, x, 10.0, -10.0, block_size="4")',
    'misspelt: acc.ScheduleName = "zb"',
]

RIGHT = [
    "acc.value_and_grad(loss, 4, reduction='sum', accum_dtype=jnp.bfloat16)",
    "acc.value_and_grad(loss, microbatch_size=2, remat=True, argnums=(0,))",
    "acc.value_and_grad(loss, 4, remat=jax.checkpoint_policies.dots_saveable)",
    "acc.value_and_grad(loss, 4, has_aux=True, aux_reduction={'a': 'stack'})",
    "acc.value_and_grad(loss, 4, pad=True, reduction='weighted', masked=True)",
    "acc.grad(loss, 4, accum_dtype=None, loss_scale=True, unroll=2)",
    "acc.value_and_grad(loss, 4, microbatch_size=None)",  # the default
    "acc.value_and_grad(loss, 4, axis_name='window', state_argnums=2)",
    "eqx_acc.filter_value_and_grad(loss, 2, axis_name='window')",
    "flax_acc.nnx_value_and_grad(loss, 2, axis_name='window')",
    "acc.pipeline_value_and_grad(loss, loss, 4, param_gather='window')",
    "acc.plan_pipeline(loss, loss, params, x, memory_budget=1, grad_reduce='auto')",
    "acc.shard_value_and_grad(loss, 4, mesh=mesh, grad_reduce='window')",
    "acc.shard_value_and_grad(loss, 4, data_axis=('data',), gather_dtype=None)",
    "acc.pipeline_value_and_grad(loss, loss, 4, mesh=mesh, schedule='1f1b')",
    "acc.pipeline_value_and_grad(loss, loss, 4, report_finite=True)",
    "acc.plan(loss, w, x, memory_budget=budget, optimizer=optax.sgd(0.1))",
    "acc.plan(loss, w, x, memory_budget=1 << 30, reduction='sum')",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, pad=True)",
    "acc.plan_modes(loss, w, x, num_microbatches=2, memory_budget=1, axis_name='w')",
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
    # data_axis=None, the documented default, is typed (issue 66, 11).
    "acc.cached_value_and_grad(loss, loss, 2, mesh=mesh, data_axis=None)",
    "losses.softmax_contrastive(x, x, jnp.exp(jnp.log(10.0)), block_size=4)",
    "losses.sigmoid_contrastive(x, x, 10.0, -10.0, block_size=2)",
    # The pipeline guide's recipe: the plan's choice passed on (issue 62, case 6).
    "plan = acc.plan_pipeline(loss, loss, params, x, memory_budget=budget)",
    "acc.pipeline_value_and_grad(loss, loss, 4, schedule=plan.schedule)",
    "acc.pipeline_value_and_grad(loss, loss, 4, schedule=plan.rows[0].schedule)",
    'name: acc.ScheduleName = "zero-bubble"',
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


# One source for each entry point's keywords: the keyword bag its signature
# ``Unpack`` s is what it accepts at run time, no more and no less.

_MODULES = ("jaxaccum", "jaxaccum.flax", "jaxaccum.equinox", "jaxaccum.testing")


def _entry_points() -> dict[str, tuple]:
    """Every public function typed ``**options: Unpack[SomeKwargs]``, by
    qualified name: the function and its keyword bag."""
    import importlib
    import inspect

    import typing_extensions

    found = {}
    for module_name in _MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            function = getattr(module, name)
            if not inspect.isfunction(function):
                continue
            for parameter in inspect.signature(function).parameters.values():
                annotation = parameter.annotation
                if typing_extensions.get_origin(annotation) is typing_extensions.Unpack:
                    (bag,) = typing_extensions.get_args(annotation)
                    found[f"{module_name}.{name}"] = (function, bag)
    return found


def _loss(w, x):
    import jax.numpy as jnp

    return jnp.mean((x @ w) ** 2)


def _call(name: str, function, **keywords):
    """Calls the entry point ``name`` on a tiny problem with ``keywords``,
    far enough that its keywords are checked (a builder is built)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    w, x = jnp.ones(3), jnp.ones((4, 3))
    short = name.rsplit(".", 1)[1]
    if short in ("linen_diagnose", "nnx_diagnose"):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0)) if short == "nnx_diagnose" else {}
        return function(_loss, model, x, num_microbatches=2, **keywords)
    if short.startswith(("filter_assert", "filter_diagnose", "assert_", "diagnose")):
        return function(_loss, w, x, num_microbatches=2, **keywords)
    if short == "plan":
        return function(_loss, w, x, memory_budget="1GiB", **keywords)
    if short == "plan_modes":
        return function(_loss, w, x, num_microbatches=2, memory_budget=1, **keywords)
    if short == "plan_pipeline":
        return function(_loss, _loss, w, x, memory_budget=1, **keywords)
    if short in ("pipeline_value_and_grad", "cached_value_and_grad"):
        return function(_loss, _loss, 2, **keywords)
    if short == "shard_value_and_grad":
        return function(_loss, 2, mesh=jax.make_mesh((1,), ("data",)), **keywords)
    return function(_loss, 2, **keywords)  # the builders


def test_every_keyword_entry_point_is_found():
    assert len(_entry_points()) == 19, sorted(_entry_points())


@pytest.mark.parametrize("name", sorted(_entry_points()))
def test_run_time_accepts_exactly_the_declared_keywords(name):
    """An undeclared keyword is refused, and the refusal lists as the entry
    point's options the keys of the bag its signature declares, and no other
    but its own keyword-only parameters (shard_value_and_grad's mesh and
    data_axis, so that a data_axes= slip is told data_axis)."""
    import inspect
    import typing

    function, bag = _entry_points()[name]
    with pytest.raises(TypeError, match="unknown keyword argument") as refusal:
        _call(name, function, undeclared_option=1)
    listed = set(
        str(refusal.value).split("its options are: ", 1)[1].rstrip(".").split(", ")
    )
    own = {
        parameter.name
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind == inspect.Parameter.KEYWORD_ONLY
    }
    declared = set(typing.get_type_hints(bag))
    assert declared <= listed <= declared | own, (name, listed ^ declared)


def _valid_values(key: str, hint) -> list:
    """Values a caller may pass for ``key`` (typed ``hint``): every one of a
    ``Literal``'s, else one that keeps the tiny problem's call as it is."""
    import typing

    import jax.numpy as jnp

    literals = [
        value
        for arm in (typing.get_args(hint) or (hint,))
        if typing.get_origin(arm) is typing.Literal
        for value in typing.get_args(arm)
    ]
    if typing.get_origin(hint) is typing.Literal:
        literals = list(typing.get_args(hint))
    if literals:
        return literals
    return [
        {
            "accum_dtype": jnp.float32,
            "unroll": 2,
            "remat": True,
            "report_stats": True,
            "report_finite": True,
            "microbatch_size": None,  # the default
            "argnums": 0,
            "batch_argnums": 1,
            "key_argnums": (),
            "state_argnums": (),
            "gather_dtype": jnp.bfloat16,
            "mesh": None,  # the default: the one set with jax.set_mesh, or none
            "data_axis": None,
            "axis_name": "window",
        }.get(key, False)  # has_aux, pad, masked, loss_scale: their default
    ]


_BUILDERS = [
    name
    for name in sorted(_entry_points())
    if "diagnose" not in name and "assert" not in name and ".plan" not in name
]


@pytest.mark.parametrize("name", _BUILDERS)
def test_every_declared_keyword_and_value_is_accepted(name):
    """Each key the bag declares, with each value its type admits (each of a
    ``Literal``'s), builds the entry point: what type-checks runs. (The
    planners and checks are covered by the test above and their own tests:
    they compile.)"""
    import typing

    function, bag = _entry_points()[name]
    for key, hint in typing.get_type_hints(bag).items():
        for value in _valid_values(key, hint):
            if (
                key == "aux_reduction"
                and "pipeline" in name
                and value
                not in (
                    "mean",
                    "sum",
                )
            ):
                # Typed AuxReduction | PyTree, which admits any value; a
                # pipeline refuses per-micro-batch aux (tests/test_pipeline.py).
                continue
            # A layout is of the axis's members: it comes with axis_name (a
            # layout alone is refused, tests/test_axis_edges.py).
            axis = {"axis_name": "window"} if key == "axis_layout" else {}
            _call(name, function, **{key: value}, **axis)
