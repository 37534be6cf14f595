"""Figures in the Markdown pages, written from the results files.

A measured figure has one source, the results file its benchmark wrote
(``benchmarks/results/*.json``). A page does not copy it by hand: it holds a
marker naming the figure, followed by the value this module wrote there::

    <!-- fig memory.json: results.mlp.temp_bytes.jaxaccum as mib -->6.6 MiB<!-- /fig -->

Both comments are invisible on GitHub and on the site, so either shows
``6.6 MiB``, and the committed text is what both render. After a benchmark
run, ``python docs/_figures.py --write`` rewrites every marker's value;
``python docs/_figures.py --check`` (a test runs it) fails, naming the file,
line, figure, committed and generated value, when a page is stale. Both take
Markdown files, by default every one git tracks.

The marker's spec is ``FILE: PATH as FORMAT``. The path is the JSON's keys
joined by dots (a key may hold spaces, ``/`` and ``=``; a list takes an index,
``rows.3``, or a selector, ``measurements[contender=jaxaccum,num_microbatches=16]``,
the one element whose fields equal those values). The format:

- ``gib``, ``mib``, ``kib``: bytes as ``15.29 GiB``, ``6.6 MiB``, ``40.3 KiB``;
  ``mib2``: as ``17.09``;
- ``ms``, ``us``: seconds as ``71.8 ms``, ``288 us``;
- ``x``, ``x3``: a ratio as ``0.72x``, ``0.102x``;
- ``pct``: a fraction as ``1.7%``;
- ``yesno``: a boolean as ``yes`` / ``no``; ``names``: a list of names as
  ``fixed N=4, fixed N=8`` (``-`` when empty);
- ``range x`` (any format after ``range``): a ``{min, median, max}`` object as
  its range, ``0.16-0.24x``; ``spread .2f`` as ``0.27 / **0.36** / 0.39``;
  ``median x`` and the like take one field;
- anything else is a Python format spec: ``.2f``, ``,d``, ``.1e``.

Two more forms keep a table of figures readable: ``A / B`` divides two
values (``f.json: a.seconds / b.seconds as x``), and a page may name a part
of a file once, in a comment, and start its paths there::

    <!-- figures: mlp = compare/results.json: models.mlp.measurements -->
    <!-- fig mlp: [contender=jaxaccum,num_microbatches=16].temp_bytes as mib -->...

A page may also hold the older macro, ``{{ memory.json: PATH | mib }}``:
``--write`` turns it into a marker (``--check`` fails while one remains, as
GitHub shows it raw). A marker must not begin a line: GitHub and the site
would read the line as raw HTML; ``--write`` moves the word before it onto its
line. Nor may it sit in a formula (MathJax would read the comment): write the
figure beside the formula. Markers in code (spans and fenced blocks) are text.

A name that is not in its file fails, with where it was asked, so a figure
cannot silently go stale.
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
from typing import Any, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
ALIAS = re.compile(r"<!--\s*figures:\s*(\w+)\s*=\s*([\w./-]+\.json)\s*:\s*(\S+)\s*-->")
SELECTOR = re.compile(r"^(.*)\[(.+)\]$")
SPEC = re.compile(r"^([\w./-]+)\s*:\s*(.+)\s+as\s+(.+)$")
# A marker (its spec and the value written after it), or an older macro.
FIGURE = re.compile(
    r"<!-- fig (?P<spec>.+?) -->(?P<value>.*?)<!-- /fig -->"
    r"|\{\{\s*(?P<name>[\w./-]+)\s*:\s*(?P<path>.+?)\s*\|\s*(?P<format>[^}]+?)\s*\}\}"
)
# Code (fenced blocks, then spans; a span does not cross a blank line), whose
# markers are text, and formulas (arithmatex's delimiters).
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1", flags=re.S | re.M)
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(?:[^\n]|\n(?![ \t]*\n))+?(?<!`)\1(?!`)")
MATH = re.compile(
    r"\\\((?:[^\n]|\n(?![ \t]*\n))*?\\\)|\\\[.*?\\\]|\$\$.*?\$\$"
    r"|(?<![\\$])\$(?![\s$])[^$\n]*?(?<![\s\\])\$",
    flags=re.S,
)
# What may precede a marker at the start of a line: indentation, and the
# markers of list items and quotes (a marker there cannot be moved).
LINE_START = re.compile(r"^([ \t]*)((?:(?:[-*+]|\d+[.)]|>)[ \t]+)*)<!-- fig ", re.M)


class FigureError(Exception):
    """A figure that cannot be written: a name not in its results file, or a
    marker where it would not render."""


class Change(NamedTuple):
    """A figure whose committed text is not what ``--write`` writes."""

    where: str
    line: int
    spec: str
    committed: str
    generated: str

    def __str__(self) -> str:
        return (
            f"{self.where}:{self.line}: {self.spec}\n"
            f"  committed: {self.committed}\n  generated: {self.generated}"
        )


def _step(value: Any, key: str) -> Any:
    selector = SELECTOR.match(key)
    if selector:
        value = _step(value, selector.group(1)) if selector.group(1) else value
        wanted = dict(pair.split("=", 1) for pair in selector.group(2).split(","))
        matches = [
            item
            for item in value
            if all(str(item.get(field)) == want for field, want in wanted.items())
        ]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} elements match [{selector.group(2)}]")
        return matches[0]
    if isinstance(value, list):
        return value[int(key)]
    return value[key]


def lookup(data: Any, path: str) -> Any:
    """The value at ``path`` (keys joined by dots) in the loaded JSON ``data``."""
    value = data
    # A dot splits keys, except inside a [selector] (``a[x=0.5].b``).
    for key in re.findall(r"(?:[^.\[]|\[[^\]]*\])+", path):
        value = _step(value, key)
    return value


def render(value: Any, spec: str) -> str:
    """``value`` written in the format ``spec`` (the module's list)."""
    kind, _, rest = spec.partition(" ")
    if kind == "range":
        low, high = render(value["min"], rest), render(value["max"], rest)
        unit = re.search(r"[^\d.]*$", high).group(0)
        return f"{low.removesuffix(unit) if unit else low}-{high}"
    if kind == "spread":
        low, middle, high = (render(value[k], rest) for k in ("min", "median", "max"))
        return f"{low} / **{middle}** / {high}"
    if kind in ("min", "median", "max"):
        return render(value[kind], rest)
    units = {
        "gib": lambda v: f"{v / 2**30:.2f} GiB",
        "mib": lambda v: f"{v / 2**20:.1f} MiB",
        "mib2": lambda v: f"{v / 2**20:.2f}",
        "kib": lambda v: f"{v / 2**10:.1f} KiB",
        "ms": lambda v: f"{v * 1e3:.1f} ms",
        "us": lambda v: f"{v * 1e6:.3g} us",
        "x": lambda v: f"{v:.2f}x",
        "x3": lambda v: f"{v:.3f}x",
        "pct": lambda v: f"{v * 100:.1f}%",
        "yesno": lambda v: "yes" if v else "no",
        "names": lambda v: ", ".join(v) or "-",
    }
    if spec in units:
        return units[spec](value)
    return format(value, spec)


class Results:
    """The results files under ``root``, each read once."""

    def __init__(self, root: pathlib.Path = ROOT / RESULTS) -> None:
        self.root = root
        self.files: dict[str, Any] = {}

    def figure(self, name: str, path: str, spec: str) -> str:
        """The value at ``path`` in results file ``name``, in format ``spec``."""
        if name not in self.files:
            self.files[name] = json.loads((self.root / name).read_text())
        data = self.files[name]
        try:
            return render(lookup(data, path), spec)
        except (KeyError, IndexError, ValueError, TypeError):
            # Not one key: ``A / B``, or a key that is not there at all.
            if " / " not in path:
                raise
        numerator, denominator = path.split(" / ")
        return render(lookup(data, numerator) / lookup(data, denominator), spec)


def _blank_out(text: str, pattern: re.Pattern) -> str:
    """``text`` with what ``pattern`` matches replaced by NULs (newlines kept),
    so a search of the rest finds the same offsets and lines."""
    return pattern.sub(lambda match: re.sub(r"[^\n]", "\0", match.group(0)), text)


def _prose(markdown: str) -> str:
    """``markdown`` with its code blanked out."""
    return _blank_out(_blank_out(markdown, FENCE), CODE_SPAN)


class Page:
    """One Markdown file's figures, written from ``results``."""

    def __init__(self, markdown: str, where: str, results: Results) -> None:
        self.markdown, self.where, self.results = markdown, where, results
        prose = _prose(markdown)
        self.aliases = {name: (file, base) for name, file, base in ALIAS.findall(prose)}
        self.formulas = [match.span() for match in MATH.finditer(prose)]

    def _value(self, spec: str, line: int) -> str:
        parsed = SPEC.match(spec)
        if parsed is None or "--" in spec:
            raise FigureError(
                f"{self.where}:{line}: {spec!r} is not FILE: PATH as FORMAT "
                "(without '--', which ends an HTML comment)"
            )
        name, path, fmt = parsed.groups()
        if name in self.aliases:
            name, base = self.aliases[name]
            path = " / ".join(
                base + ("" if part.startswith("[") else ".") + part
                for part in (part.strip() for part in path.split(" / ", 1))
            )
        elif not name.endswith(".json"):
            raise FigureError(f"{self.where}:{line}: {spec}: no figures named {name!r}")
        try:
            return self.results.figure(name, path, fmt)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as error:
            raise FigureError(
                f"{self.where}:{line}: figure {spec!r} cannot be read from "
                f"{RESULTS}/{name}: {error!r}"
            ) from error

    def _written(self, match: re.Match) -> tuple[str, Change | None]:
        line = self.markdown.count("\n", 0, match.start()) + 1
        if any(start < match.start() < end for start, end in self.formulas):
            raise FigureError(
                f"{self.where}:{line}: {match.group(0)} is inside a formula, "
                "where MathJax would read the marker: write it beside the formula"
            )
        spec, committed = match.group("spec"), match.group("value")
        if spec is None:
            spec = f"{match['name']}: {match['path']} as {match['format']}"
            committed = f"{match.group(0)} (a macro, shown raw on GitHub)"
        generated = self._value(spec, line)
        marker = f"<!-- fig {spec} -->{generated}<!-- /fig -->"
        if committed == generated:
            return marker, None
        return marker, Change(self.where, line, spec, committed, generated)

    def write(self) -> tuple[str, list[Change]]:
        """The page with every figure written from the results (macros made
        markers, no marker beginning a line), and what that changed."""
        pieces, changes, position = [], [], 0
        for match in FIGURE.finditer(_prose(self.markdown)):
            marker, change = self._written(match)
            pieces += [self.markdown[position : match.start()], marker]
            changes += [change] if change else []
            position = match.end()
        pieces.append(self.markdown[position:])
        markdown, moved = _unstart_lines("".join(pieces), self.where)
        return markdown, changes + moved


def _continues_paragraph(line: str) -> bool:
    """Whether ``line`` is a paragraph's text (or a list item's) that the next
    line continues: not blank, a heading, a table row, a quote, HTML, a fence,
    a rule or a hard break."""
    first = line.lstrip()[:1]
    return bool(
        first
        and first not in "#|><"
        and not re.match(r"[ \t]*(```|~~~)|[ \t]*([-=*_])(?:[ \t]*\2)*[ \t]*$", line)
        and not line.endswith(("  ", "\\"))
    )


def _unstart(markdown: str, match: re.Match, where: str) -> tuple[str, Change]:
    """``markdown`` with the marker ``match`` found at a line's start moved off
    it: the last word of the line before comes onto its line, or, when that
    line holds one word, the two lines join."""
    lines = markdown.split("\n")
    index = markdown.count("\n", 0, match.start())
    previous = lines[index - 1].rstrip() if index else ""
    if match.group(2) or not _continues_paragraph(lines[index - 1] if index else ""):
        raise FigureError(
            f"{where}:{index + 1}: a figure begins a line, which GitHub and "
            "the site would read as raw HTML: put a word before it"
        )
    indent, marked = match.group(1), lines[index]
    word = re.search(r"(?<=\S)[ \t]+([^\s<>`|]+)$", previous)
    left = previous[: word.start()] if word else ""
    if word and not re.fullmatch(r"[ \t]*(?:(?:[-*+]|\d+[.)])[ \t]*)?", left):
        moved = [left, f"{indent}{word.group(1)} {marked[len(indent) :]}"]
    else:
        moved = [f"{previous} {marked.lstrip()}"]
    lines[index - 1 : index + 1] = moved
    change = Change(
        where,
        index + 1,
        "a figure begins the line",
        committed=f"{previous}⏎{marked}",
        generated="⏎".join(moved),
    )
    return "\n".join(lines), change


def _unstart_lines(markdown: str, where: str) -> tuple[str, list[Change]]:
    """``markdown`` with no marker beginning a line: a comment opening a line
    starts an HTML block for GitHub and for Python-Markdown, which breaks the
    paragraph."""
    changes = []
    while match := LINE_START.search(_prose(markdown)):
        markdown, change = _unstart(markdown, match, where)
        changes.append(change)
    return markdown, changes


def tracked_pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every Markdown file git tracks under ``root``, a linked one once."""
    listed = subprocess.run(
        ["git", "ls-files", "*.md"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    files = [root / name for name in listed if not (root / name).is_symlink()]
    return [file for file in files if file.is_file()]


def _where(file: pathlib.Path) -> str:
    try:
        return str(file.resolve().relative_to(ROOT))
    except ValueError:
        return str(file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python docs/_figures.py", description=__doc__.split("\n\n")[0]
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the figures")
    mode.add_argument("--check", action="store_true", help="fail if any is stale")
    parser.add_argument(
        "files", nargs="*", type=pathlib.Path, help="default: every tracked *.md"
    )
    args = parser.parse_args(argv)
    results, written, changes, errors = Results(), {}, [], []
    for file in args.files or tracked_pages():
        try:
            written[file], changed = Page(
                file.read_text(), _where(file), results
            ).write()
        except FigureError as error:
            errors.append(str(error))
            continue
        changes += changed
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    if args.check:
        for change in changes:
            print(change, file=sys.stderr)
        if changes:
            print(
                f"{len(changes)} stale: python docs/_figures.py --write",
                file=sys.stderr,
            )
        return 1 if changes else 0
    for file, markdown in written.items():
        if markdown != file.read_text():
            file.write_text(markdown)
    print(f"{len(changes)} figures rewritten in {len(written)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
