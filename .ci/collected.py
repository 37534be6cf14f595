"""What each CI phase collects, against the record in .ci/collected.json.

CI's time is budgeted per phase (docs/development.md). Seconds on a shared
machine cannot be checked, but what a phase collects can: this script
collects the suite once (``pytest --collect-only``, in process) and counts,
per phase, the tests it runs: ``tests`` (everything, the README's
``pytest``) and ``isa`` (``-m numerics``: what each instruction-set rerun
runs). A phase that collects more than its recorded count plus the stated
margin fails the run until the record is updated in the same diff, so a
round that adds work says so. Every kind of claim the reruns prove
(``tests/conftest.py``'s ``CLAIMS``) must select at least one test.

    python .ci/collected.py            check, print the table
    python .ci/collected.py --write    record the counts of this checkout
"""

import argparse
import contextlib
import io
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / ".ci" / "collected.json"
MARGIN = 0.02  # a phase may grow by 2% (and by at least 5 tests) unrecorded
MIN_MARGIN = 5


class _Collector:
    """A pytest plugin that keeps the collected items' node ids and markers."""

    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


def collect() -> tuple[dict[str, int], dict[str, int]]:
    """The count of each phase, and of each kind of claim's tests."""
    collector = _Collector()
    args = ["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        code = pytest.main(args, plugins=[collector])
    if code != 0:
        sys.exit(f"{output.getvalue()[-4000:]}\ncollection failed (pytest exit {code})")
    from conftest import CLAIMS, claim_of, matches  # tests/ is on the path now

    nodeids = [item.nodeid for item in collector.items]
    unmatched = [
        pattern
        for patterns in CLAIMS.values()
        for pattern in patterns
        if not any(matches(nodeid, pattern) for nodeid in nodeids)
    ]
    if unmatched:
        sys.exit(
            f"tests/conftest.py's CLAIMS name tests that are not collected: {unmatched}"
        )
    numerics = [i for i in collector.items if i.get_closest_marker("numerics")]
    phases = {"tests": len(collector.items), "isa": len(numerics)}
    claims = {kind: 0 for kind in CLAIMS}
    for item in numerics:
        claims[claim_of(item.nodeid)] += 1
    return phases, claims


def allowed(recorded: int) -> int:
    return recorded + max(MIN_MARGIN, int(MARGIN * recorded))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the counts")
    write = parser.parse_args().write
    phases, claims = collect()
    empty = [kind for kind, count in claims.items() if count == 0]
    if empty:
        sys.exit(f"kinds of claim no rerun test selects (tests/conftest.py): {empty}")
    if write:
        RECORD.write_text(json.dumps(phases, indent=2) + "\n")
    recorded = json.loads(RECORD.read_text())
    print(f"{'phase':<8} {'collected':>9} {'recorded':>9} {'allowed':>8}")
    grown = []
    for phase, count in phases.items():
        limit = allowed(recorded[phase])
        print(f"{phase:<8} {count:>9} {recorded[phase]:>9} {limit:>8}")
        if count > limit:
            grown.append(phase)
    print(f"{len(claims)} kinds of claim rerun under each instruction set")
    if grown:
        sys.exit(
            f"{grown} collected more than recorded (+{MARGIN:.0%}, at least "
            f"{MIN_MARGIN}): say so in the diff with `python .ci/collected.py "
            "--write`, and check the phase's time against its budget "
            "(docs/development.md)"
        )


if __name__ == "__main__":
    main()
