"""Helpers shared by the benchmarks: machine description, streaming a subprocess with timestamps, tables."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m['date']} | {m['cpus']} CPU cores ({m['cpu_model']}), GPU: {m['gpu']} | "
        f"torch {m['torch']}, Python {m['python']} | load average at start {m.get('loadavg_at_start')}"
    )


def run_streaming(
    cmd: list[str],
    env: dict[str, str] | None = None,
    echo: bool = False,
    on_line=None,
    cwd: Path | None = None,
) -> tuple[int, float, list[tuple[float, str]]]:
    """Run cmd in `cwd` (default: the repository), timestamp every output line (seconds since launch); returns
    (rc, wall_s, [(t, line)])."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONUNBUFFERED"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        t = time.perf_counter() - t0
        line = line.rstrip("\n")
        lines.append((t, line))
        if echo:
            print(f"    [{t:7.2f}s] {line}", flush=True)
        if on_line is not None:
            on_line(t, line)
    rc = proc.wait()
    return rc, time.perf_counter() - t0, lines


class RunFailed(SystemExit):
    """A benchmarked command ended with a non-zero exit code; uncaught, it ends the benchmark with its last
    output (`tail`)."""

    def __init__(self, what: str, rc: int, tail: str):
        super().__init__(f"{what} failed with exit code {rc}:\n{tail}")
        self.rc, self.tail = rc, tail


def busy_s() -> float | None:
    """Machine-wide busy CPU seconds so far (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    v = [int(x) for x in fields]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_measured(
    cmd: list[str], what: str, env: dict[str, str] | None = None, echo: bool = False, cwd: Path | None = None
) -> dict:
    """run_streaming(cmd), measured: {"wall_s", "lines", "load1" (before it), "other_cores" (the CPU that
    processes other than it used meanwhile, in cores; None without /proc/stat)}; RunFailed on a non-zero exit."""
    load = os.getloadavg()[0]
    b0, c0 = busy_s(), children_cpu_s()
    rc, wall, lines = run_streaming(cmd, env=env, echo=echo, cwd=cwd)
    b1, c1 = busy_s(), children_cpu_s()
    if rc != 0:
        raise RunFailed(what, rc, "\n".join(line for _, line in lines[-25:]))
    other = None if b0 is None or b1 is None else max(0.0, (b1 - b0) - (c1 - c0)) / wall
    return {"wall_s": wall, "lines": lines, "load1": load, "other_cores": other}


def once_more_on_failure(attempt, what: str) -> tuple[Any, list[str]]:
    """attempt(), and once more if it raises RunFailed -> (its result, the first failure or nothing). The
    hand-written torch workers have ended with SIGABRT from gloo now and then, at random, on this machine; a
    second failure ends the benchmark with the run's last output."""
    try:
        return attempt(), []
    except RunFailed as first:
        print(f"  {what}: failed with exit code {first.rc}; run again", flush=True)
        return attempt(), [f"exit code {first.rc}"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def sgd_overrides(lr: float, momentum: float, weight_decay: float) -> list[str]:
    """`ddpkit train` keys for what a hand-written loop does: SGD (Nesterov) at a constant lr, no scaling."""
    return [
        "optim.name=sgd",
        f"optim.lr={lr}",
        "optim.ref_batch_size=null",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
        f"optim.momentum={momentum}",
        "optim.nesterov=true",
        f"optim.weight_decay={weight_decay}",
    ]


def python() -> str:
    return sys.executable


def alternated(rounds: int, sides: tuple[str, str], run, label: str, unit: str) -> list[dict[str, Any]]:
    """`run(side)` for both sides `rounds` times, alternately (A B, B A, ...), each run printed as it ends; run
    returns a dict with the rate under `unit`, "load1", "other_cores" and "wall_s"; the runs, "side" added."""
    runs = []
    for rnd in range(rounds):
        for side in sides if rnd % 2 == 0 else sides[::-1]:
            r = {"side": side, **run(side)}
            print(
                f"  {label} round {rnd + 1} {side}: {r[unit]:.0f} {unit.replace('_per_s', '')}/s "
                f"(load {r['load1']:.1f}, other {r['other_cores'] or 0:.2f} cores, {r['wall_s']:.0f} s)",
                flush=True,
            )
            runs.append(r)
    return runs


def compared(
    runs: list[dict[str, Any]], sides: tuple[str, str], unit: str
) -> tuple[dict[str, float], str, str]:
    """({side: median rate}, each round's ratio "0.98 / 1.01", the load averages' range "2.1-3.4") of `runs`."""
    import statistics

    med = {s: statistics.median(r[unit] for r in runs if r["side"] == s) for s in sides}
    a, b = ([r[unit] for r in runs if r["side"] == s] for s in sides)
    each = " / ".join(f"{x / y:.2f}" for x, y in zip(a, b, strict=True))
    loads = [r["load1"] for r in runs]
    return med, each, f"{min(loads):.1f}-{max(loads):.1f}"


def add_run_options(p) -> None:
    """The options of a benchmark that runs both sides as subprocesses: --json, --echo, --dry-run (and the hidden
    --worker / --out its own hand-written side is started with)."""
    import argparse

    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--echo", action="store_true", help="show the runs' output")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)


def parse_run_args(p, argv: list[str] | None):
    """(args, the arguments given) of a benchmark with add_run_options and --epochs (2 .. E-1 timed)."""
    raw = sys.argv[1:] if argv is None else argv
    args = p.parse_args(raw)
    if args.epochs < 3:
        p.error("--epochs must be at least 3 (epochs 2 .. E-1 are timed)")
    return args, raw


def report(
    m: dict[str, Any],
    command: str,
    headers: list[str],
    table: list[list[Any]],
    verdict: str,
    json_path: Path | None,
    raw: dict[str, Any],
) -> None:
    """A benchmark's tail: the machine and the command, the table of medians, the verdict line; the raw runs
    ({"machine": m, **raw}) written to `json_path` when given."""
    print()
    print(f"Machine: {machine_line(m)}")
    print(f"Command: python {command}".rstrip())
    print()
    print(md_table(headers, table))
    print()
    print(verdict)
    if json_path:
        json_path.write_text(json.dumps({"machine": m, **raw}, indent=1))
