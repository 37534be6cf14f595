"""Griffe extension for the docs build: Sphinx roles in docstrings become links.

The docstrings cross-reference with Sphinx roles (``:func:`plan```), which
``help()`` and IDEs show as they are. mkdocstrings renders Markdown, so this
rewrites each role, before rendering, into an autorefs link to the public name
it means (``[`plan`][jaxaccum.plan]``) when the site documents that name, and
into plain code otherwise (private helpers named in private modules' docs).

Three more rewrites, for the same reason (the docstrings stay plain for
``help()``, the site gets the links):

- names of jax, optax, flax, equinox and chex, in a role or a code span
  (``jax.lax.scan``), link to their own documentation. The addresses are
  written here, not read from the projects' inventories: the build fetches
  nothing (CI has no network).
- ``:math:`...``` becomes arithmatex's inline math, which MathJax renders.
- each public function, class and module ends with its source file and
  lines in the source tree, a link when mkdocs.yml gives the repository's
  address (``source_url``; the project has none yet).
"""

import importlib
import pathlib
import re
from typing import Any

import griffe

PUBLIC_MODULES = (
    "jaxaccum",
    "jaxaccum.growth",
    "jaxaccum.losses",
    "jaxaccum.testing",
    "jaxaccum.flax",
    "jaxaccum.equinox",
)
ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj):`~?([\w.]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
# A code span that is not already a link's text: `jax.lax.scan`, `jax.jit()`.
CODE_SPAN = re.compile(
    r"(?<![\[`])(``?)((?:jax|optax|flax|nnx|linen|eqx|equinox|chex)\.[\w.]+)(\(\))?\1"
    r"(?![`\]])"
)
ROOT = pathlib.Path(__file__).resolve().parent.parent

JAX = "https://docs.jax.dev/en/latest"
OPTAX = "https://optax.readthedocs.io/en/latest/api"
NNX = "https://flax.readthedocs.io/en/latest/api_reference/flax.nnx"
LINEN = "https://flax-linen.readthedocs.io/en/latest/api_reference/flax.linen"
EQX = "https://docs.kidger.site/equinox/api"
# Names from jax's API pages follow one pattern; the rest are listed.
JAX_AUTOSUMMARY = ("jax.", "jax.lax.", "jax.random.", "jax.numpy.", "jax.tree.")
EXTERNAL = {
    "jax.Array": f"{JAX}/_autosummary/jax.Array.html",
    "jax.sharding.Mesh": f"{JAX}/jax.sharding.html#jax.sharding.Mesh",
    "jax.sharding.NamedSharding": f"{JAX}/jax.sharding.html#jax.sharding.NamedSharding",
    "jax.sharding.PartitionSpec": f"{JAX}/jax.sharding.html#jax.sharding.PartitionSpec",
    "jax.sharding.auto_axes": f"{JAX}/notebooks/explicit-sharding.html",
    "jax.sharding.explicit_axes": f"{JAX}/notebooks/explicit-sharding.html",
    "jax.stages.Compiled": f"{JAX}/jax.stages.html#jax.stages.Compiled",
    "jax.checkpoint_policies.dots_saveable": f"{JAX}/gradient-checkpointing.html",
    "jax.tree_util.keystr": f"{JAX}/_autosummary/jax.tree_util.keystr.html",
    "nnx.Module": f"{NNX}/module.html#flax.nnx.Module",
    "nnx.State": f"{NNX}/state.html#flax.nnx.State",
    "nnx.Rngs": f"{NNX}/rnglib.html#flax.nnx.Rngs",
    "nnx.Param": f"{NNX}/variables.html#flax.nnx.Param",
    "nnx.BatchStat": f"{NNX}/variables.html#flax.nnx.BatchStat",
    "nnx.Optimizer": f"{NNX}/training/optimizer.html#flax.nnx.optimizer.Optimizer",
    "nnx.value_and_grad": f"{NNX}/transforms.html#flax.nnx.value_and_grad",
    "nnx.jit": f"{NNX}/transforms.html#flax.nnx.jit",
    "nnx.pop": f"{NNX}/graph.html#flax.nnx.pop",
    "flax.training.train_state.TrainState": (
        "https://flax.readthedocs.io/en/latest/api_reference/flax.training.html"
        "#flax.training.train_state.TrainState"
    ),
    "linen.Module": f"{LINEN}/module.html#flax.linen.Module",
    "eqx.Module": f"{EQX}/module/module/#equinox.Module",
    "eqx.nn.State": f"{EQX}/nn/stateful/#equinox.nn.State",
    **{
        f"eqx.{name}": f"{EQX}/transformations/#equinox.{name}"
        for name in ("filter_jit", "filter_grad", "filter_value_and_grad")
    },
    # optax's API reference: the page each name is on.
    **{
        name: f"{OPTAX}/{page}.html#{name}"
        for page, names in {
            "transformations": (
                "optax.GradientTransformation",
                "optax.GradientTransformationExtraArgs",
            ),
            "optimizer_wrappers": (
                "optax.MultiSteps",
                "optax.MultiStepsState",
                "optax.skip_not_finite",
                "optax.skip_large_updates",
            ),
            "apply_updates": ("optax.apply_updates",),
            "combining_optimizers": ("optax.chain",),
            "utilities": ("optax.tree.norm",),
        }.items()
        for name in names
    },
    "chex.assert_trees_all_close": (
        "https://chex.readthedocs.io/en/latest/api.html#chex.assert_trees_all_close"
    ),
}


def external_url(name: str) -> str | None:
    """The documentation page of a jax, optax, flax, equinox or chex name."""
    if name in EXTERNAL:
        return EXTERNAL[name]
    if name.startswith("equinox."):
        return external_url("eqx." + name.removeprefix("equinox."))
    if name.startswith("flax.nnx."):
        return external_url("nnx." + name.removeprefix("flax.nnx."))
    namespace = name.rpartition(".")[0] + "."
    if namespace in JAX_AUTOSUMMARY:
        return f"{JAX}/_autosummary/{name}.html"
    return None


def _public_paths() -> dict[str, str]:
    """Every documented name, by its public path and by its defining path; a
    second public path of the same function leads to its first."""
    paths: dict[str, str] = {}
    # A function exported by two modules is documented once, under the first.
    documented: dict[int, str] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        paths[module_name] = module_name
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value) and id(value) in documented:
                paths[f"{module_name}.{name}"] = documented[id(value)]
                continue
            public = f"{module_name}.{name}"
            documented.setdefault(id(value), public)
            paths[public] = public
            defined = getattr(value, "__module__", None)
            if defined and hasattr(value, "__qualname__"):
                paths[f"{defined}.{value.__qualname__}"] = public
            for member in _documented_members(value):
                paths[f"{public}.{member}"] = f"{public}.{member}"
    return paths


def _documented_members(value: Any) -> list[str]:
    """The public methods and properties of a class that have docstrings: the
    members the site renders (NamedTuple fields are listed in their class's
    docstring, not rendered one by one)."""
    if not isinstance(value, type):
        return []
    return [
        member
        for member, attribute in vars(value).items()
        if not member.startswith("_")
        and (isinstance(attribute, property) or callable(attribute))
        and getattr(attribute, "__doc__", None)
    ]


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring into autorefs links."""

    def __init__(self, source_url: str | None = None) -> None:
        self.paths = _public_paths()
        self.source_url = source_url

    def _resolve(self, target: str, scope: str) -> str | None:
        """The documented path ``target`` means, seen from the object ``scope``."""
        candidates = [target, f"jaxaccum.{target}"]
        # from where the object is defined, then from where it is documented
        # (a private module's function re-exported by a public one)
        for where in dict.fromkeys([scope, self.paths.get(scope, scope)]):
            parts = where.split(".")
            candidates += [
                ".".join(parts[:i] + [target]) for i in range(len(parts), 0, -1)
            ]
        for candidate in candidates:
            if candidate in self.paths:
                return self.paths[candidate]
            # a member named from its class's defining module (Class.method)
            owner, _, member = candidate.rpartition(".")
            if owner in self.paths and f"{self.paths[owner]}.{member}" in self.paths:
                return f"{self.paths[owner]}.{member}"
        return None

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return

        def link(match: re.Match) -> str:
            target = match.group(1)
            path = self._resolve(target, obj.path)
            if path:
                return f"[`{target}`][{path}]"
            url = external_url(target)
            return f"[`{target}`]({url})" if url else f"`{target}`"

        def link_external(match: re.Match) -> str:
            url = external_url(match.group(2))
            return f"[{match.group(0)}]({url})" if url else match.group(0)

        text = ROLE.sub(link, obj.docstring.value)
        text = CODE_SPAN.sub(link_external, text)
        text = MATH_ROLE.sub(lambda match: "\\(" + match.group(1) + "\\)", text)
        obj.docstring.value = text + self._source_link(obj)

    def _source_link(self, obj: griffe.Object) -> str:
        """A closing line naming a public object's source file and lines,
        linked when ``source_url`` says where the repository is."""
        if obj.path not in self.paths or obj.is_attribute:
            return ""
        try:
            path = pathlib.Path(obj.filepath).resolve().relative_to(ROOT).as_posix()
        except (ValueError, TypeError):
            return ""
        if self.source_url is None:
            lines = "" if obj.is_module else f", lines {obj.lineno}-{obj.endlineno}"
            return f"\n\nSource: `{path}`{lines}."
        lines = "" if obj.is_module else f"#L{obj.lineno}-L{obj.endlineno}"
        return f"\n\n[Source: `{path}`]({self.source_url}/{path}{lines})"
