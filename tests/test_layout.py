"""The library a training stack imports: its surface, its imports, its options."""

import ast
import dataclasses
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest
import typing_extensions

import jaxaccum
from jaxaccum import _types
from jaxaccum._cached import _library
from jaxaccum._pipeline import _spec
from jaxaccum._window import _shard_spec
from jaxaccum._window import _spec as _window_spec

PACKAGE = pathlib.Path(jaxaccum.__file__).parent


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_import_jaxaccum_loads_none_of_the_extras_nor_chex():
    result = _run(
        """
        import sys
        import jax.numpy as jnp
        import jaxaccum
        step = jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 2)
        value, grads = step(jnp.ones(3), jnp.ones((4, 3)))
        assert float(value) == 3.0, value
        heavy = ["flax", "matplotlib", "rich", "chex", "equinox", "orbax"]
        print(sorted(name for name in heavy if name in sys.modules))
        jaxaccum.testing.assert_grads_match_full_batch(
            lambda w, x: jnp.mean(x @ w), jnp.ones(3), jnp.ones((4, 3)),
            num_microbatches=2)
        print("chex" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    loaded, chex_after_testing = result.stdout.split()
    assert loaded == "[]", f"import jaxaccum loaded {loaded}"
    assert chex_after_testing == "True"


@pytest.mark.parametrize(
    "module, extra, missing",
    [
        ("jaxaccum.flax", "flax", "flax"),
        ("jaxaccum.equinox", "equinox", "equinox"),
        ("jaxaccum.cli", "cli", "flax"),
    ],
)
def test_a_missing_extra_names_the_install_command(module, extra, missing):
    result = _run(
        f"""
        import sys
        sys.modules["{missing}"] = None  # as if it were not installed
        try:
            import {module}
        except ImportError as error:
            print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert f'pip install "jaxaccum[{extra}]"' in result.stdout


def test_no_module_is_named_like_a_public_function():
    modules = {info.name for info in pkgutil.iter_modules([str(PACKAGE)])}
    public_modules = {name for name in modules if not name.startswith("_")}
    assert public_modules == {"testing", "flax", "equinox", "cli", "growth", "losses"}
    namespaces = {"testing", "growth", "losses"}  # the sub-namespaces, in __all__
    assert not (public_modules - namespaces) & set(jaxaccum.__all__)
    for name in jaxaccum.__all__:
        assert not inspect.ismodule(getattr(jaxaccum, name)) or name in namespaces


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "jaxaccum"
            ):
                offenders += [
                    f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and alias.name != "__version__"
                    # a private module is imported whole; its names are not
                    and not PACKAGE.joinpath(
                        *node.module.split(".")[1:], f"{alias.name}.py"
                    ).exists()
                ]
    assert not offenders, offenders


def test_init_only_re_exports():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    ]
    # __dir__: the public names; __getattr__: the lazy jaxaccum.testing and
    # jaxaccum.losses, and the moved names' shims. Nothing else.
    assert defined == ["__dir__", "__getattr__"]
    assert jaxaccum.__version__ == "0.1.0"


def test_a_source_tree_on_pythonpath_imports_without_installed_metadata():
    """No installed distribution (a checkout on PYTHONPATH, as on a machine
    the source was copied to): the import works, the version says unknown."""
    script = textwrap.dedent(
        """
        import importlib.metadata as metadata
        found = metadata.version

        def version(name):
            if name == "jaxaccum":
                raise metadata.PackageNotFoundError(name)
            return found(name)

        metadata.version = version
        import jaxaccum
        print(jaxaccum.__version__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0+unknown"


CORE = {
    "DynamicLossScale",
    "FiniteReport",
    "LossScaleReport",
    "MemoryPlan",
    "MemoryPlanRow",
    "ModePlan",
    "ModePlanRow",
    "MultiSteps",
    "MultiStepsState",
    "NoiseEstimates",
    "PipelinePlan",
    "PipelinePlanRow",
    "ScheduleName",
    "StageOrder",
    "WindowStats",
    "accumulate",
    "cached_value_and_grad",
    "dynamic_loss_scale",
    "grad",
    "masked_sum",
    "pad_microbatches",
    "parse_memory_budget",
    "pipeline_stage_order",
    "pipeline_value_and_grad",
    "plan",
    "plan_modes",
    "plan_pipeline",
    "register_batch_node",
    "select_if_finite",
    "shard_batch",
    "shard_value_and_grad",
    "split_batch",
    "update_loss_scale",
    "value_and_grad",
}


def test_the_top_level_is_the_core_and_three_namespaces():
    """dir(jaxaccum) is the core, jaxaccum.growth, jaxaccum.losses and
    jaxaccum.testing; the export list is the re-exported names, one list (no
    name exported twice)."""
    assert set(dir(jaxaccum)) == CORE | {"growth", "losses", "testing"}
    assert sorted(jaxaccum.__all__) == sorted(dir(jaxaccum))
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    re_exported = {
        alias.asname
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    assert re_exported | {"losses", "testing"} == set(jaxaccum.__all__)
    for name in ("jaxaccum.growth", "jaxaccum.losses", "jaxaccum.testing"):
        namespace = importlib.import_module(name)
        assert not set(namespace.__all__) & CORE, name


@pytest.mark.parametrize("name", sorted(jaxaccum._MOVED))
def test_moved_names_warn_with_their_new_path(name):
    """Each 0.1 top-level name that moved still works, for one release, with
    a DeprecationWarning naming where it went; it is the new object."""
    module, new_name = jaxaccum._MOVED[name]
    with pytest.warns(
        DeprecationWarning,
        match=rf"jaxaccum\.{name} moved to "
        rf"{module}\.{new_name}; .* removed in jaxaccum 0\.3\.0",
    ):
        old = getattr(jaxaccum, name)
    assert old is getattr(importlib.import_module(module), new_name)
    if module == "jaxaccum._shims":  # keeps 0.1's meaning or refuses its call
        assert issubclass(old, getattr(jaxaccum.growth, new_name))


def test_the_noise_scale_shim_refuses_a_per_window_decay():
    """0.1's NoiseScaleEMA(0.9) decayed per window; the shim ran it as
    half_life=0.9 examples, another average (a noise scale of 60 where 0.1
    read 131; issue 45, case 4). It refuses the call with the conversion;
    half_life= builds the growth namespace's class."""
    with pytest.warns(DeprecationWarning):
        shim = jaxaccum.NoiseScaleEMA
    for call in (lambda: shim(0.9), lambda: shim(decay=0.9)):
        with pytest.raises(
            TypeError, match=r"0\.1's call, a decay per window.*6\.58 B"
        ):
            call()
    ema = shim(half_life=256)
    assert ema == jaxaccum.growth.NoiseScaleEMA(half_life=256)
    assert type(ema) is jaxaccum.growth.NoiseScaleEMA


def test_old_factory_calls_build_the_controllers():
    with pytest.warns(DeprecationWarning):
        ramp = jaxaccum.batch_ramp(8, {0: 1, 16: 2})
    assert ramp == jaxaccum.growth.BatchRamp(8, {0: 1, 16: 2})
    with pytest.warns(DeprecationWarning):
        controller = jaxaccum.noise_scale_batch(4, max_microbatches=16, step_cost=16)
    assert controller == jaxaccum.growth.NoiseScaleBatch(4, 16, step_cost=16)


@pytest.mark.parametrize("name", ["NoiseScaleState", "ramp_from_schedule"])
def test_removed_names_say_why(name):
    with pytest.raises(AttributeError, match=f"jaxaccum.{name} was removed: "):
        getattr(jaxaccum, name)
    # On the from path too (Python's own "cannot import name" said only that).
    with pytest.raises(ImportError, match=f"jaxaccum.{name} was removed: "):
        exec(f"from jaxaccum import {name}", {})
    assert not hasattr(jaxaccum, name)


def _keywords(function) -> dict[str, inspect.Parameter | None]:
    """The keywords ``function`` takes by name, as a type checker reads them:
    its keyword-only parameters and the keys of its ``**options:
    Unpack[SomeKwargs]`` (None: a key, whose default is the option's)."""
    keywords: dict[str, inspect.Parameter | None] = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            keywords[name] = parameter
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            assert typing_extensions.get_origin(parameter.annotation) is (
                typing_extensions.Unpack
            ), f"{function.__name__} takes **{name} untyped"
            (bag,) = typing_extensions.get_args(parameter.annotation)
            keywords.update(dict.fromkeys(bag.__annotations__))
    return keywords


def test_grad_has_value_and_grads_explicit_keywords():
    grad_parameters = inspect.signature(jaxaccum.grad).parameters
    assert grad_parameters == inspect.signature(jaxaccum.value_and_grad).parameters
    assert "kwargs" not in grad_parameters and "keywords" not in grad_parameters
    loss = lambda w, x: jnp.mean(x @ w)  # noqa: E731
    with pytest.raises(TypeError, match="rduction"):
        jaxaccum.grad(loss, 2, rduction="sum")
    with pytest.raises(TypeError, match="data_axes"):  # an option, not a keyword
        jaxaccum.grad(loss, 2, data_axes=("data",))


def test_options_are_one_frozen_object_whose_allowed_values_are_derived():
    """The core window, its sharding and a pipeline's layout are three
    objects: each front end's keywords are the fields of the ones it builds."""
    fields = {field.name for field in dataclasses.fields(_window_spec.WindowSpec)}
    keywords = set(_keywords(jaxaccum.value_and_grad)) | {"num_microbatches"}
    assert keywords <= fields and fields - keywords == {"sharding"}
    sharding = {field.name for field in dataclasses.fields(_shard_spec.Sharding)}
    sharded = set(_shard_spec.SHARD_KEYWORDS)
    assert sharding - sharded == {"data_axes", "param_specs"}  # set per call
    assert sharded <= set(_keywords(jaxaccum.shard_value_and_grad))
    pipeline = {field.name for field in dataclasses.fields(_spec.PipelineWindow)}
    assert pipeline - fields == {"layout"}  # set by pipeline_value_and_grad
    assert _types.REDUCTIONS == ("mean", "sum", "weighted")
    assert "concat" in _types.AUX_REDUCTIONS
    options = _window_spec.WindowSpec(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_microbatches = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="reduction must be one of"):
        _window_spec.WindowSpec(4, reduction="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_reduce must be one of"):
        _window_spec.WindowSpec.create(
            "f", 4, {"grad_reduce": "never"}, _types.ShardKwargs
        )


def _loss(w, x):
    return jnp.mean(x @ w)


# Every front end that takes accumulation options, called with one option
# spelled as `keywords`: (its name in messages, the call).
def _front_end_calls(keywords: dict) -> dict:
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    import jaxaccum.equinox
    import jaxaccum.flax

    w, x = jnp.ones(2), jnp.ones((4, 2))
    dense = nn.Dense(1)
    variables = dense.init(jax.random.key(0), x)

    def linen_loss(variables, batch):
        return jnp.mean(dense.apply(variables, batch))

    linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))

    def eqx_loss(model, batch):
        return jnp.mean(jax.vmap(model)(batch))

    nnx_model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def nnx_loss(model, batch):
        return jnp.mean(model(batch))

    mesh = jax.make_mesh((1,), ("data",))
    stages = jax.make_mesh((1,), ("stage",))
    return {
        "pipeline_value_and_grad": lambda: jaxaccum.pipeline_value_and_grad(
            lambda p, x: x @ p,
            lambda h, x, b: jnp.mean(x @ h),
            2,
            mesh=stages,
            **keywords,
        ),
        "value_and_grad": lambda: jaxaccum.value_and_grad(_loss, 2, **keywords),
        "cached_value_and_grad": lambda: jaxaccum.cached_value_and_grad(
            lambda p, x: x @ p, lambda p, z: jnp.mean(z), 2, **keywords
        ),
        "grad": lambda: jaxaccum.grad(_loss, 2, **keywords),
        "shard_value_and_grad": lambda: jaxaccum.shard_value_and_grad(
            _loss, 2, mesh=mesh, **keywords
        ),
        "filter_value_and_grad": lambda: jaxaccum.equinox.filter_value_and_grad(
            eqx_loss, 2, **keywords
        ),
        "filter_grad": lambda: jaxaccum.equinox.filter_grad(eqx_loss, 2, **keywords),
        "linen_value_and_grad": lambda: jaxaccum.flax.linen_value_and_grad(
            linen_loss, 2, **keywords
        ),
        "linen_train_step": lambda: jaxaccum.flax.linen_train_step(
            linen_loss, 2, **keywords
        ),
        "nnx_value_and_grad": lambda: jaxaccum.flax.nnx_value_and_grad(
            nnx_loss, 2, **keywords
        ),
        "assert_grads_match_full_batch": lambda: (
            jaxaccum.testing.assert_grads_match_full_batch(
                _loss, w, x, num_microbatches=2, **keywords
            )
        ),
        "diagnose": lambda: jaxaccum.testing.diagnose(
            _loss, w, x, num_microbatches=2, **keywords
        ),
        "plan": lambda: jaxaccum.plan(_loss, w, x, memory_budget="1GiB", **keywords),
        "linen_diagnose": lambda: jaxaccum.flax.linen_diagnose(
            linen_loss, variables, x, num_microbatches=2, **keywords
        ),
        "nnx_diagnose": lambda: jaxaccum.flax.nnx_diagnose(
            nnx_loss, nnx_model, x, num_microbatches=2, **keywords
        ),
        "filter_diagnose": lambda: jaxaccum.equinox.filter_diagnose(
            eqx_loss, linear, x, num_microbatches=2, **keywords
        ),
    }


def test_every_front_end_refuses_an_unknown_option_by_name():
    """Options enter one way (WindowSpec.create): a misspelled one raises in
    every front end, naming it and the front end, before any work."""
    for name, call in _front_end_calls({"rduction": "sum"}).items():
        wanted = f"{name} got an unknown keyword argument 'rduction'"
        with pytest.raises(TypeError, match=wanted):
            call()
    for name, call in _front_end_calls({"param_specs": ()}).items():
        with pytest.raises(TypeError, match=f"{name} got .* 'param_specs'"):
            call()


# The keywords a caller may set: the window's fields and its sharding's, but
# N (positional) and what the front ends set themselves.
_OPTIONS = frozenset(
    {field.name for field in dataclasses.fields(_window_spec.WindowSpec)}
    | _shard_spec.Sharding.field_names()
) - {"num_microbatches", "sharding", "data_axes", "param_specs"}

# The window as a named axis: the in-step front ends and the core's checks
# (testing's, issue 72) take it; the others do not yet (issue 67).
_NO_AXIS = ("axis_name", "axis_layout")
# What the checks and plans that compare windows leave out (COMPARE_REFUSED).
_CHECKS_OUT = (*_shard_spec.SHARD_OPTIONS, "loss_scale")
_COMPARED_OUT = (*_CHECKS_OUT, *_NO_AXIS)
# plan_modes sets the modes itself (the one its window takes with
# axis_name), and plans unscaled.
_MODES_SET = ("param_gather", "grad_reduce", "loss_scale")
_PIPELINE_PLANNED = (*_spec.PIPELINE_REFUSED, "loss_scale", *_NO_AXIS)
# cached_value_and_grad refuses what has no meaning for a whole-batch loss.
_CACHED_REFUSED = (*_library.REFUSED, *_NO_AXIS)
# The Flax front ends set the argument roles themselves.
_FLAX_ROLES = ("argnums", "batch_argnums", "key_argnums", "state_argnums")


@pytest.mark.parametrize(
    ("front_end", "exclude"),
    [
        ("value_and_grad", _shard_spec.SHARD_OPTIONS),
        ("grad", _shard_spec.SHARD_OPTIONS),
        (
            "shard_value_and_grad",
            ("state_argnums", "report_finite", "masked"),
        ),
        ("equinox.filter_value_and_grad", (*_shard_spec.SHARD_OPTIONS, "argnums")),
        ("equinox.filter_grad", (*_shard_spec.SHARD_OPTIONS, "argnums")),
        ("pipeline_value_and_grad", (*_spec.PIPELINE_REFUSED, *_NO_AXIS)),
        ("cached_value_and_grad", _CACHED_REFUSED),
        # The front ends that forward their options: what they refuse (or set
        # themselves) is what their signature leaves out.
        (
            "plan",
            (*_shard_spec.SHARD_OPTIONS, "loss_scale", "microbatch_size", "masked"),
        ),
        (
            "plan_modes",
            (
                "state_argnums",
                "report_finite",
                "masked",
                "microbatch_size",
                *_MODES_SET,
            ),
        ),
        ("plan_pipeline", (*_PIPELINE_PLANNED, "microbatch_size")),
        ("testing.assert_grads_match_full_batch", _CHECKS_OUT),
        ("testing.diagnose", _CHECKS_OUT),
        ("equinox.filter_assert_grads_match_full_batch", (*_COMPARED_OUT, "argnums")),
        ("equinox.filter_diagnose", (*_COMPARED_OUT, "argnums")),
        ("flax.linen_value_and_grad", (*_shard_spec.SHARD_OPTIONS, *_FLAX_ROLES)),
        ("flax.linen_train_step", (*_shard_spec.SHARD_OPTIONS, *_FLAX_ROLES)),
        ("flax.nnx_value_and_grad", (*_shard_spec.SHARD_OPTIONS, *_FLAX_ROLES)),
        ("flax.linen_diagnose", (*_COMPARED_OUT, *_FLAX_ROLES)),
        ("flax.nnx_diagnose", (*_COMPARED_OUT, *_FLAX_ROLES)),
    ],
)
def test_front_end_keywords_are_the_options(front_end, exclude):
    """The keywords a front end shows (``help``, IDEs, type checkers) are
    the options' fields but those it refuses or sets itself, and a docstring
    with "Keyword Args" documents each one."""
    import jaxaccum.equinox
    import jaxaccum.flax
    import jaxaccum.testing

    function = jaxaccum
    for part in front_end.split("."):
        function = getattr(function, part)
    # not a front end's own keywords (its mesh, tolerances, budget, layout)
    keyword_only = set(_keywords(function)) & _OPTIONS
    assert keyword_only == _OPTIONS - set(exclude)
    documented = inspect.getdoc(function) or ""
    if "Keyword Args:" in documented:  # the others point to their core's
        for name in keyword_only:
            assert f"\n  {name}: " in documented, f"{front_end} documents no {name}"


def test_microbatches_are_named_in_the_compiled_program():
    step = jax.jit(jaxaccum.value_and_grad(lambda w, x: jnp.mean(x @ w), 4))
    hlo = step.lower(jnp.ones(3), jnp.ones((8, 3))).compile().as_text()
    assert "jaxaccum_microbatch" in hlo  # profiler traces name the micro-batches


def test_every_claim_the_reruns_prove_names_tests_that_exist():
    """tests/conftest.py's CLAIMS (what CI reruns under each instruction set)
    names test functions that exist; .ci/collected.py checks each parameter
    against the collected suite."""
    from conftest import CLAIMS, LONGEST_FIRST

    root = pathlib.Path(__file__).parent.parent
    missing = []
    for kind, patterns in CLAIMS.items():
        assert patterns, f"{kind!r} names no test"
        for pattern in patterns:
            if pattern.endswith("/"):
                found = (root / pattern).is_dir()
            else:
                path, name = pattern.split("[")[0].split("::")
                defined = {
                    node.name
                    for node in ast.walk(ast.parse((root / path).read_text()))
                    if isinstance(node, ast.FunctionDef)
                }
                found = name in defined
            if not found:
                missing.append(pattern)
    assert not missing, f"CLAIMS name tests that do not exist: {missing}"
    absent = [path for path in LONGEST_FIRST if not (root / path).is_file()]
    assert not absent, f"LONGEST_FIRST names files that do not exist: {absent}"


def _examples_0_1() -> dict[str, str]:
    """tests/shims_0_1.txt: 0.1's docstring examples, by name."""
    text = (pathlib.Path(__file__).parent / "shims_0_1.txt").read_text()
    sections = text.split("\n## ")[1:]
    return {s.split("\n", 1)[0]: s.split("\n", 1)[1].strip() + "\n" for s in sections}


EXAMPLES_0_1 = _examples_0_1()


@pytest.mark.parametrize("name", sorted(EXAMPLES_0_1))
def test_the_shims_run_0_1s_own_examples(name):
    """Each moved name, called the way 0.1's docstring showed it: the same
    output (its meaning kept), or, for NoiseScaleEMA(decay), the refusal
    with the conversion (issue 45)."""
    text = EXAMPLES_0_1[name]
    if name == "NoiseScaleEMA":  # 0.1's call is refused, never reinterpreted
        (call,) = [line[4:] for line in text.splitlines() if "NoiseScaleEMA(" in line]
        assert call == "ema = jaxaccum.NoiseScaleEMA(decay=0.9)", call
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(TypeError, match=r"jaxaccum 0\.1's call, a decay per window"),
        ):
            exec(call, {"jaxaccum": jaxaccum})
        return
    test = doctest.DocTestParser().get_doctest(text, {}, name, "jaxaccum 0.1", 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        runner.run(test, out=lambda _: None)
    assert runner.failures == 0 and runner.tries > 0, (name, runner.summarize())


@pytest.mark.parametrize(
    "module_name",
    [
        "jaxaccum",
        "jaxaccum.flax",
        "jaxaccum.equinox",
        "jaxaccum.testing",
        "jaxaccum.losses",
        "jaxaccum.growth",
    ],
)
def test_public_docstrings_are_contracts_of_at_most_60_lines(module_name):
    """A docstring states the contract (what it equals, arguments, returns,
    raises); the mechanism, costs and sharding story live in the guides
    (issue 66: cached_value_and_grad's was 114 lines)."""
    module = importlib.import_module(module_name)
    long = {}
    for name in module.__all__:
        lines = _docstring_source_lines(getattr(module, name))
        if lines > 60:
            long[name] = lines
    assert not long, f"docstrings over 60 lines: {long}"


def _docstring_source_lines(obj) -> int:
    """The lines a docstring takes in the source, its quotes included (0
    for an object without one, or whose source cannot be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError):
        return len((inspect.getdoc(obj) or "").splitlines())
    body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return 0
    return first.end_lineno - first.lineno + 1
