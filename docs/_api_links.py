"""MkDocs hook (mkdocs.yml's ``hooks:``): the guides link names to the API.

In the home page, Getting started and the guides, the first code span on a
page that names a documented public name (`` `jaxaccum.MultiSteps` ``,
`` `value_and_grad(masked=True)` ``, `` `jaxaccum.testing.diagnose` ``; each
spelling once) becomes a link to its entry in the API reference, as a reader
expects a name to be clickable the first time it appears. Later mentions stay
plain code. The pages' Markdown stays as written (it reads the same on GitHub); the
links are autorefs' (``[`name`][jaxaccum.name]``), so a name the reference
does not document is left alone and the strict build checks every link made.

Short names (`` `value_and_grad` ``, `` `BatchRamp` ``) are linked when they
are unambiguous identifiers of ``jaxaccum``'s or ``jaxaccum.growth``'s
namespace: they hold an underscore or a capital (``plan`` or ``grad`` alone
could mean anything in prose).
"""

import importlib
import pathlib
import re
from typing import Any

PUBLIC_MODULES = (
    "jaxaccum",
    "jaxaccum.growth",
    "jaxaccum.losses",
    "jaxaccum.testing",
    "jaxaccum.flax",
    "jaxaccum.equinox",
)
PAGES = re.compile(r"^(?:index\.md|getting-started\.md|guides/[\w-]+\.md)$")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
# A code span that is not a link's text nor part of one.
CODE_SPAN = re.compile(r"(?<![\[`])`([^`]+?)`(?![`\]])")
NAME = re.compile(
    r"^((?:jaxaccum\.)?(?:(?:growth|losses|testing|flax|equinox)\.)?[A-Za-z_]\w*)(\(.*\))?$",
    re.S,
)
DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)


def _documented(docs_dir: pathlib.Path) -> dict[str, str]:
    """Every name the API reference documents, by the names a page may use
    for it: ``jaxaccum.testing.diagnose``, and ``MultiSteps`` for
    ``jaxaccum.MultiSteps``; a second public name of a function leads to the
    entry of its first."""
    entries = set()
    for page in (docs_dir / "api").glob("*.md"):
        entries.update(DIRECTIVE.findall(page.read_text()))
    # The modules' own pages, except `jaxaccum`, the project's name in prose.
    names = {module: module for module in PUBLIC_MODULES[1:] if module in entries}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            public = f"{module_name}.{name}"
            target = public if public in entries else _entry_of(getattr(module, name))
            if target in entries:
                names.setdefault(public, target)
                short = module_name in ("jaxaccum", "jaxaccum.growth")
                if short and ("_" in name or name != name.lower()):
                    names.setdefault(name, target)
    return names


def _entry_of(value: Any) -> str | None:
    jaxaccum = importlib.import_module("jaxaccum")
    for name in jaxaccum.__all__:
        if getattr(jaxaccum, name) is value:
            return f"jaxaccum.{name}"
    return None


class ApiLinks:
    def __init__(self, docs_dir: pathlib.Path) -> None:
        self.names = _documented(docs_dir)

    def link_first_uses(self, markdown: str) -> str:
        linked: set[str] = set()

        def link(match: re.Match) -> str:
            name = NAME.match(match.group(1))
            target = self.names.get(name.group(1)) if name else None
            if target is None or name.group(1) in linked or "\n\n" in match.group(1):
                return match.group(0)
            linked.add(name.group(1))
            return f"[{match.group(0)}][{target}]"

        pieces, position = [], 0
        for fence in FENCE.finditer(markdown):
            pieces.append(CODE_SPAN.sub(link, markdown[position : fence.start()]))
            pieces.append(fence.group(0))
            position = fence.end()
        pieces.append(CODE_SPAN.sub(link, markdown[position:]))
        return "".join(pieces)


_links: ApiLinks | None = None


def on_config(config: Any) -> Any:
    global _links
    _links = ApiLinks(pathlib.Path(config["docs_dir"]))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if _links is None or not PAGES.match(page.file.src_uri):
        return markdown
    return _links.link_first_uses(markdown)
