"""The built documentation site is tested like code.

The site is built once per session (``mkdocs build --strict``, notebooks not
executed: about 10 s), or read from ``$JAXACCUM_SITE`` when CI has just built
it with the notebooks executed. Then:

- every internal link of every page leads to a file of the site, and every
  ``#anchor`` to an ``id`` on the target page (the strict build checks the
  Markdown pages' links, not the anchors of rendered notebooks or docstrings);
- searching any public name finds its API entry: the search index is
  tokenized as the browser's lunr does, with mkdocs.yml's separator, and the
  name's tokens are all in the entry's section;
- every measured figure reads as its value: no page shows a ``{{ }}`` macro
  or the text of a figure's marker (``docs/_figures.py``).
"""

import functools
import html
import html.parser
import http.server
import importlib
import json
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PUBLIC_MODULES = (
    "jaxaccum",
    "jaxaccum.growth",
    "jaxaccum.losses",
    "jaxaccum.testing",
    "jaxaccum.flax",
    "jaxaccum.equinox",
)
DIRECTIVE = re.compile(r"^::: ([\w.]+)", flags=re.M)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", flags=re.I)
TAG = re.compile(r"<[^>]+>")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    if os.environ.get("JAXACCUM_SITE"):
        return pathlib.Path(os.environ["JAXACCUM_SITE"])
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "JAXACCUM_DOCS_EXECUTE": "false", "NO_MKDOCS_2_WARNING": "1"}
    # The notebooks as committed: their executed copies (CI's docs phase) may
    # still be being written by tests/test_notebooks.py in another process.
    env.pop("JAXACCUM_EXECUTED_NOTEBOOKS", None)
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


def test_page_titles_are_unique(site):
    """Search and the browser's tabs show page titles: no two alike."""
    titles: dict[str, list[str]] = {}
    for path in sorted(site.rglob("*.html")):
        found = re.search(r"<title>(.*?)</title>", path.read_text(encoding="utf-8"))
        if found and path.name != "404.html":
            titles.setdefault(found.group(1), []).append(str(path.relative_to(site)))
    twice = {title: paths for title, paths in titles.items() if len(paths) > 1}
    assert twice == {}, f"pages with the same title: {twice}"


def test_no_address_of_a_project_site_that_does_not_exist(site):
    """The project has no public address yet: no link, install line, sitemap
    entry or search text may point at one (``github.com/jaxaccum/...``)."""
    own = re.compile(
        r"(?:https?:)?//[\w.-]*jaxaccum[\w.-]*(?:/[^\s\"'<>)]*)?|[\w.-]+/jaxaccum/jaxaccum"
    )
    found = {}
    for path in sorted(site.rglob("*")):
        if path.suffix in (".html", ".json", ".xml", ".txt", ".js", ".ipynb"):
            hits = set(own.findall(path.read_text(encoding="utf-8", errors="replace")))
            if hits:
                found[str(path.relative_to(site))] = sorted(hits)[:3]
    assert found == {}, f"addresses of a project site that does not exist: {found}"


# A formula written as code: |G|^2, tr(Sigma), sqrt(S), sum_k, B_noise / B.
ASCII_FORMULA = re.compile(
    r"\^|\bsqrt\(|\btr\(|Sigma|\|\w[^|]*\w\||\bsum_k\b|\bB_(?:simple|noise|crit)\b"
)


def test_api_reference_writes_formulas_in_mathjax(site):
    """A formula in a docstring is :math:`...` (MathJax on the site), never
    code that spells it in ASCII beside the rendered ones."""
    found = {}
    for page in sorted((site / "api").rglob("index.html")):
        # Inline code only: a code block (a doctest) may compute with sqrt.
        prose = re.sub(r"<pre[\s>].*?</pre>", "", page.read_text(), flags=re.S)
        spans = re.findall(r"<code>(.*?)</code>", prose, flags=re.S)
        texts = (html.unescape(TAG.sub("", span)) for span in spans)
        ascii = [t for t in texts if "\n" not in t and ASCII_FORMULA.search(t)]
        if ascii:
            found[str(page.relative_to(site))] = ascii
    assert found == {}, f"formulas written as ASCII code in the API reference: {found}"


def test_guides_link_public_names_to_the_api_on_first_use(site):
    """In the home page, Getting started and the guides, the first code span
    naming a documented public name is a link to its API entry."""
    entries = _api_entries()
    pages = [site / "index.html", site / "getting-started" / "index.html"]
    pages += sorted((site / "guides").glob("*/index.html"))
    unlinked = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        article = text[text.find("<article") : text.find("</article>")]
        missed = []
        for name in set(entries) - {"jaxaccum"}:
            first = re.search(rf"<code>{re.escape(name)}(?:\(|</code>)", article)
            if first and not re.search(r"<a [^>]*>$", article[: first.start()]):
                missed.append(name)
        if missed:
            unlinked[str(page.relative_to(site))] = missed
    assert unlinked == {}, f"public names first named without a link: {unlinked}"


def test_figures_enlarge_on_click(site):
    """Every figure in a page opens full size in a lightbox (mkdocs-glightbox):
    the multi-panel ones are shown at under half their width."""
    bare = {}
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        article = text[text.find("<article") : text.find("</article>")]
        images = re.findall(r"(<a [^>]*>)?\s*<img ([^>]*)>", article)
        missing = [
            re.search(r'src="([^"]{0,80})', attributes).group(1)
            for link, attributes in images
            if 'class="glightbox"' not in link and 'src="' in attributes
        ]
        if missing:
            bare[str(page.relative_to(site))] = missing
    assert bare == {}, f"figures that do not enlarge on click: {bare}"


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
    """Every public name, less the second names of functions two modules
    export: those are documented, and found, at the first."""
    names, seen = [], set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value) and id(value) in seen:
                continue
            seen.add(id(value))
            names.append(f"{module_name}.{name}")
    return names


FIGURE_MARKER = re.compile(r"<!-- fig (.+?) -->(.*?)<!-- /fig -->")


def test_pages_show_measured_figures_not_their_markers(site):
    """A measured figure reads as its value (docs/_figures.py writes it into
    the Markdown between two comments): no page shows a ``{{ }}`` macro or a
    marker's text outside code, and each marker holds a value."""
    shown, empty, count = {}, {}, 0
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        article = text[text.find("<article") : text.find("</article>")]
        markers = FIGURE_MARKER.findall(article)
        count += len(markers)
        where = str(page.relative_to(site))
        valueless = [spec for spec, value in markers if not TAG.sub("", value).strip()]
        if valueless:
            empty[where] = valueless[:3]
        prose = re.sub(
            r"<!--.*?-->|<pre[\s>].*?</pre>|<code>.*?</code>", "", article, flags=re.S
        )
        leaks = re.findall(r"\{\{.{0,60}|&lt;!-- ?/?fig.{0,60}", prose)
        if leaks:
            shown[where] = leaks[:3]
    assert count > 0, "no figure markers in the built pages"
    assert shown == {}, f"figure macros or markers shown as text: {shown}"
    assert empty == {}, f"figure markers without a value: {empty}"


def test_search_finds_every_public_name_at_its_api_entry(site):
    docs, separator = _search(site)
    sections = {doc["location"]: doc for doc in docs}
    entries = _api_entries()
    # `jaxaccum.testing` and `jaxaccum.losses` are in jaxaccum.__all__; each
    # one's entry is its module page.
    for module in ("testing", "losses"):
        name = f"jaxaccum.{module}"
        entries[name] = entries.get(name, f"api/{module}/")
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


def _code_lines(notebook: pathlib.Path) -> set[str]:
    """The lines of a notebook's code cells that its prose does not quote."""
    cells = json.loads(notebook.read_text())["cells"]
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] != "code")
    lines = {
        line.strip()
        for cell in cells
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
    }
    return {line for line in lines if len(line) >= 20 and line not in prose}


def test_search_leaves_notebook_code_out(site):
    """Every search entry of a notebook page, the page-level one included,
    holds its prose only: no line of its code cells, prompts or copy notices."""
    docs, _ = _search(site)
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks in notebooks/"
    dumps = {}
    for notebook in notebooks:
        code = _code_lines(notebook)
        for doc in docs:
            if not doc["location"].startswith(f"notebooks/{notebook.stem}/"):
                continue
            text = html.unescape(TAG.sub(" ", doc["text"]))
            found = [line for line in code if line in text]
            if "Copied!" in text or "In [" in text:
                found.append("a prompt or copy notice")
            if found:
                dumps[doc["location"]] = f"{len(found)} code lines, e.g. {found[:2]}"
    assert dumps == {}, f"notebook code in the search index: {dumps}"


# The browser checks: the built site in headless Chromium (Debian's
# `chromium`), a handful of pages that hold every kind of code block (a page's
# code, API signatures, a notebook's cells and outputs) and formula, each at a
# desktop (1280 px) and a phone (390 px) width, with the network blocked: the
# site must render from itself. tests/site_browser.js measures; about 20 s.
BROWSER_PAGES = (
    "index.html",
    "getting-started/index.html",
    "guides/in-step/index.html",
    "guides/noise-scale/index.html",
    "api/accumulate/index.html",
    "api/growth/index.html",
    "notebooks/01_quickstart/index.html",
)
WIDTHS = (1280, 390)
# A desktop's first screen: 1280 x 800.
FIRST_SCREEN = 800


def _chromium() -> str | None:
    return os.environ.get("JAXACCUM_CHROMIUM") or shutil.which("chromium")


class _Harness(http.server.SimpleHTTPRequestHandler):
    """Serves the site, and at /__check__.html the page that loads the others."""

    harness = ""

    def do_GET(self):
        if self.path != "/__check__.html":
            return super().do_GET()
        body = self.harness.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(site) -> dict:
    chromium = _chromium()
    if chromium is None:
        pytest.skip(
            "no chromium on PATH (apt-get install -y chromium, or set "
            "JAXACCUM_CHROMIUM): the browser checks of the site did not run"
        )
    frames = "".join(
        f'<iframe data-key="{page}@{width}" src="/{page}" '
        f'style="width:{width}px;height:{FIRST_SCREEN}px;border:0"></iframe>'
        for page in BROWSER_PAGES
        for width in WIDTHS
    )
    script = (ROOT / "tests" / "site_browser.js").read_text()
    handler = type(
        "Handler",
        (_Harness,),
        {"harness": f'{frames}<pre id="results"></pre><script>{script}</script>'},
    )
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        # Nothing but this server: a formula that needs a CDN fails.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=60000",
        "--dump-dom",
        f"http://127.0.0.1:{server.server_port}/__check__.html",
    ]
    try:
        # On a loaded machine the page can be dumped before its script has
        # measured every frame: once more, then it is a failure.
        for _ in range(2):
            dump = subprocess.run(command, capture_output=True, text=True, timeout=120)
            found = re.search(r'<pre id="results">(.*?)</pre>', dump.stdout, flags=re.S)
            if found and found.group(1):
                return json.loads(html.unescape(found.group(1)))
    finally:
        server.shutdown()
    raise AssertionError(f"no results from chromium:\n{dump.stderr[-3000:]}")


def _failures(browser: dict, field: str) -> dict:
    return {key: result[field] for key, result in browser.items() if result.get(field)}


def test_browser_measured_every_page(browser):
    errors = _failures(browser, "error")
    assert errors == {}, f"pages the browser check could not measure: {errors}"
    empty = [key for key, result in browser.items() if not result.get("lines")]
    assert empty == [], f"pages with no code measured: {empty}"


def test_wrapped_code_keeps_its_indentation(browser):
    wraps = _failures(browser, "wraps")
    count = sum(map(len, wraps.values()))
    assert wraps == {}, (
        f"{count} code lines wrap to a continuation at or left of their own "
        f"indentation:\n{json.dumps(wraps, indent=1)}"
    )


def test_code_needs_no_sideways_scrolling_on_a_desktop(browser):
    overflows = {
        key: result["overflows"] + (["(the page)"] if result["page_overflow"] else [])
        for key, result in browser.items()
        if key.endswith("@1280") and (result["overflows"] or result["page_overflow"])
    }
    assert overflows == {}, f"code that scrolls sideways at 1280 px: {overflows}"


def test_every_formula_renders_offline(browser):
    formulas = sum(result["formulas"] for result in browser.values())
    assert formulas > 0, "no formulas on the checked pages"
    unrendered = _failures(browser, "unrendered")
    assert unrendered == {}, f"formulas not rendered, network blocked: {unrendered}"


def test_install_is_on_the_home_pages_first_screen(browser):
    bottom = browser["index.html@1280"]["install_bottom"]
    assert bottom is not None, "no `pip install` block on the home page"
    assert bottom <= FIRST_SCREEN, (
        f"the home page's install block ends {bottom:.0f} px down, below the "
        f"first screen ({FIRST_SCREEN} px at 1280 px wide)"
    )
