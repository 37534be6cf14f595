"""Shared pieces of the benchmark scripts: where results go, the machine, and
how repeated measurements are summarised.

The timing and memory harness itself is `jaxaccum.cli.harness` (also behind
`jaxaccum bench`), and the models are `jaxaccum.cli.models`. This module
imports only the standard library at import time, so `import_time.py` can use
it in a core-only install.
"""

import json
import pathlib
import statistics

RESULTS = pathlib.Path(__file__).parent / "results"


def spread(values: list[float]) -> dict[str, float]:
    """Min / median / max of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def against_full(times: dict[str, list[float]], temps: dict[str, int]) -> dict:
    """Interleaved rounds' times and compiled temporaries per contender, and
    each against the ``"full"`` contender's: the rounds' ratios (a round's
    contenders share its load) and the temporaries' ratio."""
    full = [float(t) for t in times["full"]]
    return {
        "seconds": {name: spread(t) for name, t in times.items()},
        "over_full": {
            name: spread([a / b for a, b in zip(t, full, strict=True)])
            for name, t in times.items()
        },
        "temp_bytes": temps,
        "temp_over_full": {name: temp / temps["full"] for name, temp in temps.items()},
    }


def write_json(name: str, payload: dict) -> pathlib.Path:
    from jaxaccum.cli.harness import machine  # needs the cli extra

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path
