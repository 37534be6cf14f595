"""MkDocs hooks for the notebook pages (mkdocs.yml's ``hooks:``).

mkdocs-jupyter renders a notebook as nbconvert's HTML. Two things a reader
needs from that page are added here:

- a link to download the notebook (mkdocs-jupyter copies it beside the page,
  ``include_source: true``) and where it is in the source tree (a link when
  mkdocs.yml has a ``repo_url``);
- its code out of the search index: the inputs, their "In [ ]:" prompts, the
  copy buttons' "Copied!" and the code they copy (a hidden ``div`` of the
  cell's source, which the page-level entry held) and the printed outputs are
  marked
  ``data-search-exclude`` (Material's search skips such elements), so a search
  hit on a notebook lands on its prose, not on a dump of its code.

Material's search parser matches a skipped element's end by tag name, so only
elements with no descendant of their own tag are marked (``pre``, the prompts,
the notice ``span``), never the cell's nested ``div``s.

On every page, a code span naming a file of the repository
(`` `tests/test_distributed.py` ``, `` `benchmarks/compare.py` ``) links to
that file in the repository when mkdocs.yml has a ``repo_url`` and the file
exists.
"""

import os
import pathlib
import re
from typing import Any

EXCLUDED = re.compile(
    r"<(pre(?=[\s>])"
    r'|div(?= class="(?:jp-(?:In|Out)putPrompt|clipboard-copy-txt))'
    r'|span(?= class="notice"))'
)


REPO_PATH = re.compile(
    r"<code>((?:\.ci|benchmarks|docs|jaxaccum|notebooks|tests)/[\w./-]+)"
    r"(?:::\w+)?</code>"
)


def _link_repository_paths(html: str, config: Any) -> str:
    if not config.get("repo_url"):
        return html
    root = pathlib.Path(config["config_file_path"]).parent
    blob = f"{config['repo_url'].rstrip('/')}/blob/main"

    def link(match: re.Match) -> str:
        before = html[: match.start()]
        inside_a_link = before.rfind("<a ") > before.rfind("</a>")
        if inside_a_link or not (root / match.group(1)).exists():
            return match.group(0)
        return f'<a href="{blob}/{match.group(1)}">{match.group(0)}</a>'

    return REPO_PATH.sub(link, html)


def _exclude_code_from_search(html: str) -> str:
    return EXCLUDED.sub(r"<\1 data-search-exclude", html)


def _notebook_links(page: Any, config: Any) -> str:
    name = page.file.src_uri.rsplit("/", 1)[-1]
    source = f"<code>{page.file.src_uri}</code> in the source tree"
    if config.get("repo_url"):
        blob = f"{config['repo_url'].rstrip('/')}/blob/main/{page.file.src_uri}"
        source = f'<a href="{blob}">view it in the repository</a>'
    return (
        '<p class="jaxaccum-notebook-links">'
        f'<a href="{name}" download>Download the notebook</a> · {source} '
        "(committed without outputs; this page shows them)</p>"
    )


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    html = _link_repository_paths(html, config)
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    html = _exclude_code_from_search(html)
    # The links go right under the notebook's title.
    title_end = html.find("</h1>")
    if title_end == -1:
        return _notebook_links(page, config) + html
    title_end += len("</h1>")
    return html[:title_end] + _notebook_links(page, config) + html[title_end:]


def on_files(files: Any, config: Any) -> Any:
    """With ``JAXACCUM_EXECUTED_NOTEBOOKS=DIR``, the notebook pages render the
    copies ``tests/test_notebooks.py`` executed into ``DIR`` (outputs included),
    so CI executes each notebook once per instruction set, not again here; set
    ``JAXACCUM_DOCS_EXECUTE=false`` with it. A missing copy fails the build."""
    directory = os.environ.get("JAXACCUM_EXECUTED_NOTEBOOKS")
    if not directory:
        return files
    for file in files:
        name = pathlib.PurePosixPath(file.src_uri).name
        if file.src_uri.startswith("notebooks/") and name.endswith(".ipynb"):
            executed = pathlib.Path(directory) / name
            if not executed.is_file():
                raise FileNotFoundError(
                    f"{executed}: no executed copy of {file.src_uri}; run "
                    f"JAXACCUM_EXECUTED_NOTEBOOKS={directory} pytest "
                    "tests/test_notebooks.py first, or unset the variable"
                )
            file.abs_src_path = str(executed)
    return files
