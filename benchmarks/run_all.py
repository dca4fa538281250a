"""Run every benchmark (`make bench`): digits time-to-98% and ddpkit-vs-plain-DDP throughput.

Each benchmark prints its tables (Markdown) to stdout; the full output and the raw JSON go to
benchmarks/results/ (one file per benchmark, named with the date). benchmarks/RESULTS.md is curated by hand
from that output: copy the tables over when the numbers are meant to be published.

    python benchmarks/run_all.py                 # both, default settings (about 8 minutes on 2 CPU cores)
    python benchmarks/run_all.py --quick         # one seed, one repetition each (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"


def run(name: str, args: list[str], stamp: str) -> int:
    log = RESULTS_DIR / f"{name}-{stamp}.txt"
    raw = RESULTS_DIR / f"{name}-{stamp}.json"
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args, "--json", str(raw)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            fh.write(line)
        rc = proc.wait()
    print(
        f"== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s; output in {log}, raw results in {raw}\n",
        flush=True,
    )
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="one seed and one repetition (a smoke run, not for RESULTS.md)"
    )
    args = p.parse_args()
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    digits = ["--seeds", "0"] if args.quick else []
    throughput = ["--reps", "1", "--steps", "12"] if args.quick else []
    rcs = [run("digits_time_to_acc", digits, stamp), run("throughput_vs_plain_ddp", throughput, stamp)]
    print(
        f"results: {RESULTS_DIR}/*-{stamp}.txt (tables) and .json (raw); published numbers: {HERE / 'RESULTS.md'}"
    )
    return max(rcs)


if __name__ == "__main__":
    raise SystemExit(main())
