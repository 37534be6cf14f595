"""MkDocs hook (mkdocs.yml's ``hooks:``): figures quoted from the results files.

A measured figure is written once, in the results file its benchmark wrote
(``benchmarks/results/*.json``), and every page that quotes it names it there
instead of copying it, so two pages cannot disagree and a re-run updates them
all. In a page's Markdown::

    {{ memory.json: results.mlp-784-512-512-10.temp_bytes.jaxaccum | mib }}

renders as ``6.6 MiB``. The path is the JSON's keys joined by dots (a key may
hold spaces, ``/`` and ``=``; a list takes an index, ``rows.3``, or a selector,
``measurements[contender=jaxaccum,num_microbatches=16]``, the one element
whose fields equal those values). The format after ``|``:

- ``mib``, ``kib``: bytes as ``6.6 MiB``, ``40.3 KiB``; ``mib2``: as ``17.09``;
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
values (``{{ f.json: a.seconds / b.seconds | x }}``),
and a page may name a part of a file once, in a comment that neither GitHub
nor the site shows, and start its paths there::

    <!-- figures: mlp = compare/results.json: models.mlp.measurements -->
    {{ mlp: [contender=jaxaccum,num_microbatches=16].temp_bytes | mib }}

A name that is not in the file fails the build (with where it was asked), so
a figure cannot silently go stale. Results files are read from
``benchmarks/results/``, relative to mkdocs.yml.
"""

import json
import pathlib
import re
from typing import Any

from mkdocs.exceptions import PluginError

FIGURE = re.compile(r"\{\{\s*([\w./-]+)\s*:\s*(.+?)\s*\|\s*([^}]+?)\s*\}\}")
ALIAS = re.compile(r"<!--\s*figures:\s*(\w+)\s*=\s*([\w./-]+\.json)\s*:\s*(\S+)\s*-->")
SELECTOR = re.compile(r"^(.*)\[(.+)\]$")
RESULTS = "benchmarks/results"


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


class Figures:
    """The results files, each read once per build."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root / RESULTS
        self.files: dict[str, Any] = {}

    def figure(self, name: str, path: str, spec: str) -> str:
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

    def substitute(self, markdown: str, where: str) -> str:
        aliases = {name: (file, base) for name, file, base in ALIAS.findall(markdown)}

        def replace(match: re.Match) -> str:
            name, path, spec = match.groups()
            if name in aliases:
                name, base = aliases[name]
                path = " / ".join(
                    base + ("" if part.startswith("[") else ".") + part
                    for part in (part.strip() for part in path.split(" / ", 1))
                )
            elif not name.endswith(".json"):
                raise PluginError(
                    f"{where}: {match.group(0)}: no figures named {name!r}"
                )
            try:
                return self.figure(name, path, spec)
            except (OSError, KeyError, IndexError, TypeError, ValueError) as error:
                raise PluginError(
                    f"{where}: figure {match.group(0)} cannot be read from "
                    f"{RESULTS}/{match.group(1)}: {error!r}"
                ) from error

        return FIGURE.sub(replace, markdown)


_figures: Figures | None = None


def on_config(config: Any) -> Any:
    global _figures
    _figures = Figures(pathlib.Path(config["config_file_path"]).parent)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    assert _figures is not None
    return _figures.substitute(markdown, page.file.src_uri)
