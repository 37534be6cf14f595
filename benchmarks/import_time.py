"""What `import jaxaccum` adds to `import jax, optax`, from `python -X importtime`.

Run: python benchmarks/import_time.py   (writes benchmarks/results/import_time.json)

Each round starts a fresh interpreter that imports jax and optax, then
jaxaccum, and reads `-X importtime`'s cumulative microseconds of the top-level
`jax`, `optax` and `jaxaccum` entries: jaxaccum's figure is what it adds on top
of the two, since they are already loaded when it imports. Rounds are
repeated; min / median / max are reported. Uses the standard library only, so
it runs in a core-only install (as `.ci/core-only` does).
"""

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

from common import spread

_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")
MODULES = ("jax", "optax", "jaxaccum")


def one_round() -> dict[str, int]:
    """Cumulative import microseconds of each top-level module, one process."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import jax, optax, jaxaccum"],
        capture_output=True,
        text=True,
        check=True,
    )
    cumulative = {}
    for match in _LINE.finditer(result.stderr):
        _, total, indent, name = match.groups()
        if len(indent) == 1 and name in MODULES:  # top level only
            cumulative[name] = int(total)
    return cumulative


def measure(rounds: int) -> dict:
    samples = [one_round() for _ in range(rounds)]
    base = [s["jax"] + s["optax"] for s in samples]
    added = [s["jaxaccum"] for s in samples]
    ratios = [a / b for a, b in zip(added, base, strict=True)]
    return {
        "rounds": rounds,
        "jax_optax_ms": spread([us * 1e-3 for us in base]),
        "jaxaccum_adds_ms": spread([us * 1e-3 for us in added]),
        "ratio": spread(ratios),
    }


def _machine() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("jax", "optax")
    )
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {versions}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = measure(args.rounds)
    ms, added, ratio = (
        results["jax_optax_ms"],
        results["jaxaccum_adds_ms"],
        results["ratio"],
    )
    print(
        f"import jax, optax: {ms['median']:.0f} ms median; import jaxaccum adds "
        f"{added['median']:.1f} ms (min {added['min']:.1f}, max {added['max']:.1f}) "
        f"= {ratio['median']:.1%} (min {ratio['min']:.1%}, max {ratio['max']:.1%}) "
        f"over {args.rounds} rounds"
    )
    if not args.no_write:
        path = pathlib.Path(__file__).parent / "results" / "import_time.json"
        path.write_text(json.dumps({"machine": _machine(), **results}, indent=2) + "\n")
        print(f"Wrote {path}")


if __name__ == "__main__":
    main()
