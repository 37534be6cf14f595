"""Time per step, compiled memory and compile time vs N, against the peers.

Run: python benchmarks/compare.py [--quick]   (the same as `jaxaccum bench`)

Writes benchmarks/results/compare/{results.json, results.md, *.png}. The
contenders, the harness and the models are in `jaxaccum.cli.harness` and
`jaxaccum.cli.models`; see benchmarks/README.md for the figures.
"""

import pathlib
import sys

from jaxaccum import cli

if __name__ == "__main__":
    out = pathlib.Path(__file__).parent / "results" / "compare"
    sys.exit(cli.main(["bench", "--out", str(out), *sys.argv[1:]]))
