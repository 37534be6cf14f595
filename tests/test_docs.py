"""The documentation is tested like code.

Every Python block of the README and of each page of the site (docs/) runs,
top to bottom, in a namespace of its own per page, so a page's examples are
self-contained: a reader can copy a page and run it. The API reference
documents every public name: the ``::: name`` directives of docs/api/ are
compared with the ``__all__`` of each public module, both ways.
"""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
# The site's own pages; docs/notebooks and docs/benchmarks link to folders
# whose pages hold no Python blocks (the notebooks are run by test_notebooks).
PAGES = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted(DOCS.glob("guides/*.md")),
]
PUBLIC_MODULES = ("jaxaccum", "jaxaccum.testing", "jaxaccum.flax", "jaxaccum.equinox")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_examples_run(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for index, block in enumerate(PYTHON_BLOCK.findall(page.read_text())):
        try:
            exec(
                compile(block, f"{_page_id(page)} python block {index}", "exec"),
                namespace,
            )
        except Exception as error:
            raise AssertionError(
                f"{_page_id(page)}: python block {index} failed:\n{block}"
            ) from error


def test_guides_have_examples():
    guides = sorted(DOCS.glob("guides/*.md"))
    assert guides, f"no guides in {DOCS / 'guides'}"
    bare = [
        _page_id(page) for page in guides if not PYTHON_BLOCK.search(page.read_text())
    ]
    assert not bare, f"guides without a runnable python example: {bare}"


def _public_names() -> tuple[set[str], dict[str, str]]:
    """The public names, and the second names of functions two modules export
    (``jaxaccum.testing.window_bytes`` is ``jaxaccum.window_bytes``), each
    with the first, where the reference documents it."""
    public = set(PUBLIC_MODULES)
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value, path = getattr(module, name), f"{module_name}.{name}"
            if callable(value) and id(value) in first:
                aliases[path] = first[id(value)]
            else:
                first.setdefault(id(value), path)
                public.add(path)
    return public, aliases


def test_api_reference_lists_every_public_name_once():
    directives = []
    for page in sorted((DOCS / "api").glob("*.md")):
        directives += DIRECTIVE.findall(page.read_text())
    documented = set(directives)
    public, aliases = _public_names()
    # `jaxaccum.testing` is in jaxaccum.__all__ and documented as a module.
    assert sorted(public - documented) == [], "public names missing from docs/api/"
    assert sorted(documented - public) == [], (
        "docs/api/ documents non-public names, or a function twice under two "
        f"names (document it once, link the other; aliases: {aliases})"
    )
    twice = sorted({name for name in directives if directives.count(name) > 1})
    assert twice == [], f"documented twice in docs/api/: {twice}"


def test_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [
        *DOCS.glob("*.md"),
        *DOCS.glob("guides/*.md"),
        *DOCS.glob("api/*.md"),
    ]
    missing = sorted(
        {str(p.relative_to(DOCS)) for p in pages}
        - set(re.findall(r"[\w/.-]+\.md", nav))
    )
    assert missing == [], f"pages missing from mkdocs.yml's nav: {missing}"
