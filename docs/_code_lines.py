"""MkDocs hook (mkdocs.yml's ``hooks:``): code keeps its indentation when it wraps.

A code line wider than the page wraps (``white-space: pre-wrap``) rather than
scroll sideways, but a wrapped line's continuation starts at the block's left
edge, column 0, where it reads as a dedented line: in Python, indentation is
meaning. So every line of every ``<pre>`` (the pages' code, the API
signatures, the notebooks' cells) becomes a block of its own that carries its
indentation, ``<span class="jaxaccum-line" style="--hang: 8">`` (4 spaces of
indentation, 4 more for a continuation), and
stylesheets/extra.css gives it a hanging indent: the first line at column 0
(its leading spaces are its indentation), a continuation 4 columns past the
line's own indentation.

The line breaks become the blocks' boundaries, so copying a block (Material's
copy button reads ``innerText``) gives one newline per line, as written.
"""

import html
import re
from typing import Any

PRE = re.compile(r"(<pre\b[^>]*>)(.*?)(</pre>)", flags=re.S)
CODE = re.compile(r"(<code\b[^>]*>)(.*)(</code>)", flags=re.S)
TAG = re.compile(r"<(/?)([a-zA-Z][\w-]*)[^>]*?(/?)>")
VOID = {"br", "img", "wbr", "input", "hr"}
# Continuation lines start this many columns past their line's indentation.
HANG = 4


def _lines(inner: str) -> list[tuple[str, int]]:
    """``inner`` split at its newlines, each line's tags closed and reopened
    so that it is well-formed HTML alone, with its indentation in columns."""
    lines: list[tuple[str, int]] = []
    open_tags: list[tuple[str, str]] = []
    current = ""
    position = 0
    for tag in TAG.finditer(inner + "<end-of-code/>"):
        for index, text in enumerate(inner[position : tag.start()].split("\n")):
            if index:
                closing = "".join(f"</{name}>" for name, _ in reversed(open_tags))
                lines.append((current + closing, 0))
                current = "".join(opening for _, opening in open_tags)
            current += text
        position = tag.end()
        closing, name, self_closing = tag.groups()
        if name == "end-of-code":
            break
        current += tag.group(0)
        if closing:
            while open_tags and open_tags.pop()[0] != name:
                pass
        elif not self_closing and name.lower() not in VOID:
            open_tags.append((name, tag.group(0)))
    lines.append((current, 0))
    return [(line, _indentation(line)) for line, _ in lines]


def _indentation(line: str) -> int:
    text = html.unescape(TAG.sub("", line))
    return len(text) - len(text.lstrip(" "))


def _split(inner: str) -> str:
    lines = _lines(inner)
    # The newline that ends the last line is not a line of its own.
    if len(lines) > 1 and not TAG.sub("", lines[-1][0]).strip():
        *lines, (trailing, _) = lines
        lines[-1] = (lines[-1][0] + trailing, lines[-1][1])
    return "".join(
        f'<span class="jaxaccum-line" style="--hang: {indent + HANG}">{line}</span>'
        for line, indent in lines
    )


def _split_pre(match: re.Match) -> str:
    opening, inner, closing = match.groups()
    code = CODE.search(inner)
    if code is None:
        return opening + _split(inner) + closing
    wrapped = code.group(1) + _split(code.group(2)) + code.group(3)
    return opening + inner[: code.start()] + wrapped + inner[code.end() :] + closing


def split_code_lines(html_text: str) -> str:
    """Every ``<pre>`` of ``html_text`` with its lines as indented blocks."""
    return PRE.sub(_split_pre, html_text)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return split_code_lines(html)
