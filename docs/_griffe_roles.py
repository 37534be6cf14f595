"""Griffe extension for the docs build: Sphinx roles in docstrings become links.

The docstrings cross-reference with Sphinx roles (``:func:`plan```), which
``help()`` and IDEs show as they are. mkdocstrings renders Markdown, so this
rewrites each role, before rendering, into an autorefs link to the public name
it means (``[`plan`][jaxaccum.plan]``) when the site documents that name, and
into plain code otherwise (private helpers named in private modules' docs).
"""

import importlib
import re
from typing import Any

import griffe

PUBLIC_MODULES = ("jaxaccum", "jaxaccum.testing", "jaxaccum.flax", "jaxaccum.equinox")
ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj):`~?([\w.]+)`")


def _public_paths() -> dict[str, str]:
    """Every documented name, by its public path and by its defining path."""
    paths: dict[str, str] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        paths[module_name] = module_name
        for name in module.__all__:
            public = f"{module_name}.{name}"
            value = getattr(module, name)
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

    def __init__(self) -> None:
        self.paths = _public_paths()

    def _resolve(self, target: str, scope: str) -> str | None:
        """The documented path ``target`` means, seen from the object ``scope``."""
        candidates = [target, f"jaxaccum.{target}"]
        parts = scope.split(".")
        candidates += [".".join(parts[:i] + [target]) for i in range(len(parts), 0, -1)]
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
            return f"[`{target}`][{path}]" if path else f"`{target}`"

        obj.docstring.value = ROLE.sub(link, obj.docstring.value)
