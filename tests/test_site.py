"""The built documentation site is tested like code.

The site is built once per session (``mkdocs build --strict``, notebooks not
executed: about 10 s), or read from ``$JAXACCUM_SITE`` when CI has just built
it with the notebooks executed. Then:

- every internal link of every page leads to a file of the site, and every
  ``#anchor`` to an ``id`` on the target page (the strict build checks the
  Markdown pages' links, not the anchors of rendered notebooks or docstrings);
- searching any public name finds its API entry: the search index is
  tokenized as the browser's lunr does, with mkdocs.yml's separator, and the
  name's tokens are all in the entry's section.
"""

import html
import html.parser
import importlib
import json
import os
import pathlib
import posixpath
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PUBLIC_MODULES = ("jaxaccum", "jaxaccum.testing", "jaxaccum.flax", "jaxaccum.equinox")
DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", flags=re.I)
TAG = re.compile(r"<[^>]+>")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    if os.environ.get("JAXACCUM_SITE"):
        return pathlib.Path(os.environ["JAXACCUM_SITE"])
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "JAXACCUM_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr}"
    return site_dir


class _Page(html.parser.HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for key in ("id", "name"):
            if attributes.get(key):
                self.ids.add(attributes[key])
        if tag in ("a", "link") and attributes.get("href"):
            self.links.append(attributes["href"])
        if tag in ("img", "script") and attributes.get("src"):
            self.links.append(attributes["src"])


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _target(site: pathlib.Path, page: pathlib.Path, link: str):
    """The file and fragment an internal link of ``page`` points to."""
    url = urllib.parse.urlsplit(link)
    if not url.path:
        return page, urllib.parse.unquote(url.fragment)
    base = posixpath.dirname(page.relative_to(site).as_posix())
    path = posixpath.normpath(posixpath.join(base, urllib.parse.unquote(url.path)))
    target = site / path
    if link.split("#")[0].endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, urllib.parse.unquote(url.fragment)


def test_internal_links_and_anchors_resolve(site):
    pages = {
        path: _parse(path)
        for path in sorted(site.rglob("*.html"))
        # 404.html is served at any depth, so its links are absolute (site_url).
        if path.name != "404.html"
    }
    assert len(pages) > 20, f"only {len(pages)} pages in {site}"
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            if EXTERNAL.match(link) or link == "#":
                continue
            target, fragment = _target(site, page, link)
            where = f"{page.relative_to(site)}: {link}"
            if not target.is_file():
                broken.append(f"{where} (no file {target.relative_to(site)})")
            elif fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if fragment not in ids:
                    broken.append(f"{where} (no id {fragment!r} on the target)")
    assert broken == [], f"{len(broken)} broken links:\n" + "\n".join(broken)


def _search(site: pathlib.Path):
    index = json.loads((site / "search" / "search_index.json").read_text())
    separator = re.compile(index["config"]["separator"])
    return index["docs"], separator


def _tokens(text: str, separator: re.Pattern) -> set[str]:
    """lunr's tokenizer with Material's separator: split, lower-case, trim."""
    text = html.unescape(TAG.sub(" ", text))
    words = (re.sub(r"^\W+|\W+$", "", word.lower()) for word in separator.split(text))
    return {word for word in words if word}


def _api_entries() -> dict[str, str]:
    """Each documented name, by the search location of its API entry."""
    entries = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        location = f"api/{page.stem}/" if page.stem != "index" else "api/"
        for name in DIRECTIVE.findall(page.read_text()):
            # A module's page documents it without a heading of its own.
            module = name in PUBLIC_MODULES
            entries[name] = location if module else f"{location}#{name}"
    return entries


def _public_names() -> list[str]:
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__]
    return names


def test_search_finds_every_public_name_at_its_api_entry(site):
    docs, separator = _search(site)
    sections = {doc["location"]: doc for doc in docs}
    entries = _api_entries()
    # `jaxaccum.testing` is in jaxaccum.__all__; its entry is its module page.
    entries["jaxaccum.testing"] = entries.get("jaxaccum.testing", "api/testing/")
    missed = []
    for public in _public_names():
        name = public.rsplit(".", 1)[-1]
        location = entries.get(public)
        section = sections.get(location)
        if section is None:
            missed.append(f"{public}: no search section at {location!r}")
            continue
        wanted = _tokens(name, separator)
        found = _tokens(section["title"] + " " + section["text"], separator)
        if not wanted <= found:
            missed.append(
                f"{public}: searching {name!r} (tokens {sorted(wanted)}) misses "
                f"{location}: lacks {sorted(wanted - found)}"
            )
    assert missed == [], "\n".join(missed)


def test_search_indexes_code_names_in_the_guides(site):
    docs, separator = _search(site)
    pages = {
        doc["location"].split("#")[0]
        for doc in docs
        if "value_and_grad" in _tokens(doc["title"] + " " + doc["text"], separator)
    }
    assert "guides/in-step/" in pages, f"value_and_grad found on {sorted(pages)}"


def test_search_leaves_notebook_code_out(site):
    docs, _ = _search(site)
    dumps = [
        doc["location"]
        for doc in docs
        if doc["location"].startswith("notebooks/")
        and ("Copied!" in doc["text"] or "In [" in doc["text"])
    ]
    assert dumps == [], f"notebook code in the search index: {dumps}"
