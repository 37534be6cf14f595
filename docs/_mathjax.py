"""MkDocs hook (mkdocs.yml's ``hooks:``): the site serves its own MathJax.

The formulas (pymdownx.arithmatex's, in the pages and the docstrings) are
typeset by MathJax in the browser. Loaded from a CDN, an offline reader, or
any reader when that CDN fails, sees raw TeX; so the site carries a pinned
copy: MathJax's ``tex-mml-chtml.js`` component, the TeX extensions it loads
on demand and its web fonts, copied into the built site under
``javascripts/mathjax/`` (mkdocs.yml's ``extra_javascript`` loads it there).

The copy comes from the npm registry's ``mathjax`` package at ``VERSION``
(``npm pack``, which checks the tarball against the registry's integrity
hash), fetched once into a cache outside the repository
(``$JAXACCUM_MATHJAX_CACHE``, default ``~/.cache/jaxaccum-docs``), so the
repository stays small and a build writes nothing into its tree.
"""

import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
from typing import Any

from mkdocs.exceptions import PluginError

VERSION = "3.2.2"
SCRIPT = "tex-mml-chtml.js"
FONTS = "output/chtml/fonts/woff-v2"
EXTENSIONS = "input/tex/extensions"
SITE_PATH = "javascripts/mathjax"


def _cache() -> pathlib.Path:
    root = os.environ.get("JAXACCUM_MATHJAX_CACHE") or pathlib.Path.home() / ".cache"
    return pathlib.Path(root) / "jaxaccum-docs" / f"mathjax-{VERSION}"


def _fetch(cache: pathlib.Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise PluginError(
            f"The docs serve MathJax {VERSION} from the site and fetch it with npm, "
            "which is not installed: install Node.js's npm (apt-get install -y npm), "
            f"or put MathJax's es5/ folder in {cache}."
        )
    with tempfile.TemporaryDirectory() as tmp:
        packed = subprocess.run(
            [npm, "pack", f"mathjax@{VERSION}", "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
        )
        if packed.returncode != 0:
            raise PluginError(
                f"npm pack mathjax@{VERSION} failed (the docs serve MathJax from the "
                f"site):\n{packed.stderr}"
            )
        wanted = tuple(
            f"package/es5/{path}" for path in (SCRIPT, f"{FONTS}/", f"{EXTENSIONS}/")
        )
        staging = pathlib.Path(tmp) / "es5"
        with tarfile.open(next(pathlib.Path(tmp).glob("mathjax-*.tgz"))) as tarball:
            for member in tarball.getmembers():
                if member.isfile() and member.name.startswith(wanted):
                    target = staging / member.name.removeprefix("package/es5/")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tarball.extractfile(member).read())
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, cache, dirs_exist_ok=True)


def on_config(config: Any) -> Any:
    cache = _cache()
    if (
        not all(any((cache / path).glob("*")) for path in (FONTS, EXTENSIONS))
        or not (cache / SCRIPT).is_file()
    ):
        _fetch(cache)
    return config


def on_post_build(config: Any) -> None:
    shutil.copytree(
        _cache(), pathlib.Path(config["site_dir"]) / SITE_PATH, dirs_exist_ok=True
    )
