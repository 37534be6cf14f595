"""Shared pieces of the benchmark scripts: where results go, and the machine.

The timing and memory harness itself is `jaxaccum.cli._bench` (also behind
`jaxaccum bench`), and the models are `jaxaccum.cli._models`.
"""

import json
import pathlib

from jaxaccum.cli._bench import machine

RESULTS = pathlib.Path(__file__).parent / "results"


def write_json(name: str, payload: dict) -> pathlib.Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path
