"""The documentation is tested like code.

Every Python block of the README and of each page of the site (docs/) runs,
top to bottom, in a namespace of its own per page, so a page's examples are
self-contained: a reader can copy a page and run it. The API reference
documents every public name: the ``::: name`` directives of docs/api/ are
compared with the ``__all__`` of each public module, both ways. The measured
figures the pages hold are those their results files give
(``docs/_figures.py --check``), and a figure's marker reads as its value both
on GitHub and on the site.
"""

import importlib
import importlib.util
import json
import pathlib
import re

import markdown
import markdown_it
import pytest
from mkdocs.utils.yaml import yaml_load

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
# The site's own pages; docs/notebooks and docs/benchmarks link to folders
# whose pages hold no Python blocks (the notebooks are run by test_notebooks).
PAGES = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted(DOCS.glob("guides/*.md")),
]
PUBLIC_MODULES = (
    "jaxaccum",
    "jaxaccum.growth",
    "jaxaccum.losses",
    "jaxaccum.testing",
    "jaxaccum.flax",
    "jaxaccum.equinox",
)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)
_spec = importlib.util.spec_from_file_location("_figures", DOCS / "_figures.py")
figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(figures)


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
    (a function re-exported under a second name), each
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


def test_the_guides_the_library_names_exist():
    """A message that sends its reader to a guide (``diagnose``'s causes, the
    refusals) names a page that is there."""
    named = {
        match
        for source in (ROOT / "jaxaccum").rglob("*.py")
        for match in re.findall(r"docs/[\w/.-]+\.md", source.read_text())
    }
    assert named, "no guide named in jaxaccum/: the pattern is wrong"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert missing == [], f"jaxaccum/ names guides that do not exist: {missing}"


def test_the_pages_figures_are_those_of_their_results_files(capsys):
    """Every tracked Markdown file: no figure stale, no ``{{ }}`` macro left
    (GitHub shows it raw), no marker where it would not render."""
    status = figures.main(["--check"])
    assert status == 0, capsys.readouterr().err[-6000:]


# A results file of the unit tests' own, and a page quoting it.
RESULTS = {
    "rows": [
        {"n": 2, "bytes": 3 * 2**20, "seconds": 0.004},
        {"n": 4, "bytes": 5 * 2**20, "seconds": 0.002},
    ]
}
PAGE = """# Memory

<!-- figures: rows = r.json: rows -->
| N | bytes | speed-up |
|---|---|---|
| 2 | <!-- fig rows: [n=2].bytes as mib -->3.0 MiB<!-- /fig --> | **<!-- fig rows: [n=2].seconds / [n=4].seconds as x -->2.00x<!-- /fig -->** |

At N=4 it holds **<!-- fig r.json: rows.1.bytes as mib -->5.0 MiB<!-- /fig -->**
(`<!-- fig r.json: example as x -->` in code is text).
"""  # noqa: E501


@pytest.fixture
def results(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(RESULTS))
    return figures.Results(tmp_path)


def _write(page: str, results) -> tuple[str, list]:
    return figures.Page(page, "guide.md", results).write()


def test_a_current_page_is_left_as_it_is(results):
    written, changes = _write(PAGE, results)
    assert changes == [] and written == PAGE, [str(change) for change in changes]


def test_a_stale_figure_is_rewritten_and_reported(results):
    stale = PAGE.replace("5.0 MiB<!--", "4.0 MiB<!--")
    written, changes = _write(stale, results)
    assert written == PAGE
    assert [tuple(change) for change in changes] == [
        ("guide.md", 8, "r.json: rows.1.bytes as mib", "4.0 MiB", "5.0 MiB")
    ]


def test_the_command_checks_and_rewrites_a_stale_page(tmp_path, capsys):
    page = tmp_path / "page.md"
    spec = "memory.json: results.mlp-784-512-512-10.temp_bytes.jaxaccum as mib"
    page.write_text(f"It holds <!-- fig {spec} -->0.0 MiB<!-- /fig -->.\n")
    assert figures.main(["--check", str(page)]) == 1
    assert f"{page}:1: {spec}\n  committed: 0.0 MiB\n" in capsys.readouterr().err
    assert figures.main(["--write", str(page)]) == 0
    assert figures.main(["--check", str(page)]) == 0, page.read_text()
    assert "0.0 MiB" not in page.read_text()


def test_a_missing_key_fails_naming_the_file_and_line(results):
    missing = PAGE.replace("rows.1.bytes", "rows.1.peak_bytes")
    with pytest.raises(figures.FigureError, match=r"^guide\.md:8: .*'peak_bytes'"):
        _write(missing, results)


def test_a_macro_becomes_a_marker_that_begins_no_line(results):
    macro = "A step holds\n{{ r.json: rows[n=4].bytes | mib }} at N=4.\n"
    written, changes = _write(macro, results)
    assert written == (
        "A step\nholds <!-- fig r.json: rows[n=4].bytes as mib -->5.0 MiB"
        "<!-- /fig --> at N=4.\n"
    ), changes


def test_a_figure_in_a_formula_fails(results):
    with pytest.raises(figures.FigureError, match="guide.md:1: .* inside a formula"):
        _write(
            "\\(t = <!-- fig r.json: rows.0.seconds as ms -->x<!-- /fig -->\\)", results
        )


def _markdown_extensions() -> tuple[list[str], dict]:
    """mkdocs.yml's Markdown extensions, as Python-Markdown takes them."""
    names, configs = [], {}
    for entry in yaml_load((ROOT / "mkdocs.yml").read_text())["markdown_extensions"]:
        name, config = (
            next(iter(entry.items())) if isinstance(entry, dict) else (entry, {})
        )
        names.append(name)
        configs[name] = config
    return names, configs


def test_markers_render_as_their_value_on_the_site_and_on_github(results):
    """In a table cell, in bold, in a paragraph: the site (Python-Markdown with
    mkdocs.yml's extensions) and GitHub (CommonMark with its tables, as
    markdown-it-py parses it) show the value and nothing of the marker."""
    names, configs = _markdown_extensions()
    renders = {
        "site": markdown.markdown(PAGE, extensions=names, extension_configs=configs),
        "github": markdown_it.MarkdownIt("commonmark").enable("table").render(PAGE),
    }
    for where, html in renders.items():
        shown = re.sub(r"<!--.*?-->", "", html)
        cells = re.findall(r"<td>(.*?)</td>", shown)
        assert cells == ["2", "3.0 MiB", "<strong>2.00x</strong>"], (where, html)
        assert "holds <strong>5.0 MiB</strong>\n(" in shown, (where, html)
        assert "&lt;!-- fig r.json: example as x --&gt;" in shown, (where, html)
