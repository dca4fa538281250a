"""The test suite's time per folder, from a pytest JUnit XML report.

    .venv/bin/python -m pytest tests -n 2 --dist loadgroup --junitxml=suite.xml   # or `make test` (writes it)
    python benchmarks/suite_times.py suite.xml [more.xml ...]

Prints, per test folder (tests/launcher, tests/system, ... and `tests` for the top-level modules), the tests
run, their summed time, and the slowest test; then the totals. With several files, one column per file (a
before / after table for RESULTS.md). The summed time is CPU-independent of the workers: with parallel test
workers the wall time is less than the sum.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import PurePosixPath


def folder_times(path: str) -> tuple[dict[str, float], dict[str, int], dict[str, str]]:
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    slowest: dict[str, tuple[float, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        parts = [p for p in module if not p[:1].isupper()]  # drop a test class
        folder = str(PurePosixPath("tests", *parts[1:-1])) if parts and parts[0] == "tests" else "tests"
        if parts and parts[0] != "tests":  # pytest run from inside tests/: classname has no `tests.`
            folder = str(PurePosixPath("tests", *parts[:-1]))
        t = float(case.get("time", 0.0))
        times[folder] += t
        counts[folder] += 1
        if t > slowest.get(folder, (-1.0, ""))[0]:
            slowest[folder] = (t, f"{parts[-1] if parts else '?'}::{case.get('name')}")
    return times, counts, {k: f"{v[1]} ({v[0]:.0f} s)" for k, v in slowest.items()}


def main(paths: list[str]) -> None:
    runs = [folder_times(p) for p in paths]
    folders = sorted(set().union(*(r[0] for r in runs)), key=lambda f: -runs[-1][0].get(f, 0.0))
    head = " | ".join(f"{p}: tests, s" for p in paths)
    print(f"| folder | {head} | slowest test (last file) |")
    print("| --- |" + " --- |" * len(paths) + " --- |")
    for f in folders:
        cells = " | ".join(f"{r[1].get(f, 0)}, {r[0].get(f, 0.0):.0f}" for r in runs)
        print(f"| {f} | {cells} | {runs[-1][2].get(f, '')} |")
    totals = " | ".join(f"**{sum(r[1].values())}, {sum(r[0].values()):.0f}**" for r in runs)
    print(f"| all | {totals} | |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/suite_times.py REPORT.xml [REPORT.xml ...]")
    main(sys.argv[1:])
