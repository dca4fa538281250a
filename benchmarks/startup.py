"""Start-up: from `ddpkit train --nproc-per-node 2` to its first optimizer step, and to its end.

The yardstick is what no launcher can beat on this machine: two `python -c "import torch"` started at once
(each worker has to import torch). The variants run in turn, their order rotating every round, --reps rounds:

  torch2   two `python -c "import torch"` started at once; the time until both have ended
  step2    two `python -c "import torch; ...; torch.optim.SGD(...).step()"` at once: torch and one optimizer
           step of torch's own, which imports torch._dynamo (what every first step needs: the floor)
  torchrun torch.distributed.run --standalone --nproc-per-node 2 of a hand-written script: init_process_group,
           a DDP Linear, one optimizer step, a printed step line (the hand-written path's start-up)
  after    `python -m ddpkit train --nproc-per-node 2 train.max_steps=1 train.log_every=1 out_dir=TMP` of
           this tree (src/ next to this file)
  cold     the same with DDPKIT_WARM_START=0: workers started as fresh interpreters, not forked from a fork
           server that has imported torch already
  before   the same command run on the ddpkit of --baseline REV (`git archive REV src`, unpacked into a
           temporary folder and put first on PYTHONPATH)

"first step" is the time from the command's start to the progress line printed after the first optimizer step
(`== step: [ 1/...`, train.log_every=1), read from the command's output as it comes; "whole" is the time
until the command has exited (evaluation, checkpoint, curves.png and the workers' and launcher's exit
included). For `after` and `cold`, the first metrics line's startup_* fields (what ddpkit measured itself)
are reported too. --demo also times `make demo`'s command (configs/digits.yaml, 15 epochs) to its start-up
line and its first progress line.

    python benchmarks/startup.py                        # 7 rounds of torch2, after, cold, before: ~3 minutes
    python benchmarks/startup.py --reps 5 --variants torch2 after --demo 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, machine_line, md_table, python, read_jsonl, run_streaming  # noqa: E402

TRAIN = ["train", "--nproc-per-node", "2", "train.max_steps=1", "train.log_every=1"]
DEMO = ["train", "-c", "configs/digits.yaml", "--nproc-per-node", "2"]
FIRST_STEP = re.compile(r"^== step: \[\s*1/")
TARGET_FIRST, TARGET_WHOLE = 1.5, 2.0


# one optimizer step of torch's own, which imports what every first step needs (torch._dynamo, 1.2 s here)
STEP = "import torch; p = torch.zeros(1, requires_grad=True); p.sum().backward(); torch.optim.SGD([p], lr=0.1).step()"
# the hand-written path: torch's launcher and a DDP step of the same kind, each worker printing its first step
PLAIN = (
    "import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
    "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)); "
    "m(torch.ones(3, 4)).sum().backward(); torch.optim.SGD(m.parameters(), lr=0.1).step(); "
    "print('== step: [1/1]', flush=True); dist.destroy_process_group()"
)


def python_twice(code: str = "import torch") -> dict[str, Any]:
    """Two `python -c CODE` at once: wall until both have ended."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([python(), "-c", code]) for _ in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"python -c '{code}' failed: {codes}")
    return {"whole_s": time.perf_counter() - t0}


def torchrun_plain(tmp: Path) -> dict[str, Any]:
    """torch.distributed.run of 2 workers, each one DDP optimizer step (PLAIN): first step and whole."""
    script = tmp / "plain_step.py"
    script.write_text(PLAIN + "\n")
    cmd = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    rc, wall, lines = run_streaming(cmd, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if rc != 0:
        raise SystemExit(f"torchrun of the plain step failed with exit code {rc}: {lines[-5:]}")
    first = next((t for t, line in lines if FIRST_STEP.match(line)), None)
    return {"first_step_s": first, "whole_s": wall}


def ddpkit_run(
    src: Path, args: list[str], env: dict[str, str], stop_at_first: bool = False
) -> dict[str, Any]:
    """One ddpkit command with `src` first on PYTHONPATH; the times of its first-step line and of its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) / "run"
        full_env = {
            **env,
            "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        seen: dict[str, float] = {}

        def on_line(t: float, line: str) -> None:
            if FIRST_STEP.match(line) and "first" not in seen:
                seen["first"] = t
            if line.startswith("== step:") and "progress" not in seen:
                seen["progress"] = t
            if " from the command's start to the first optimizer step" in line and "startup" not in seen:
                seen["startup"] = t

        cmd = [python(), "-m", "ddpkit", *args, f"out_dir={out_dir}"]
        rc, wall, lines = run_streaming(cmd, env=full_env, on_line=on_line)
        if rc != 0:
            tail = "\n".join(line for _, line in lines[-20:])
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {rc}:\n{tail}")
        rows = read_jsonl(out_dir / "metrics.jsonl")
    fields = {k: v for k, v in (rows[0] if rows else {}).items() if k.startswith("startup_")}
    return {
        "first_step_s": seen.get("first"),
        "startup_line_s": seen.get("startup"),
        "first_progress_line_s": seen.get("progress"),
        "whole_s": wall,
        **fields,
    }


def baseline_src(rev: str, into: Path) -> Path:
    """src/ of git revision `rev`, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], capture_output=True, check=True
    ).stdout
    tar_path = into / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, unit: str = " s") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def spread(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return "-" if not vals else f"{min(vals):.2f} .. {max(vals):.2f}"


def report(results: dict[str, list[dict[str, Any]]], commands: dict[str, str]) -> str:
    base = med(results.get("torch2", []), "whole_s")
    rows = []
    for name, runs in results.items():
        first, whole = med(runs, "first_step_s"), med(runs, "whole_s")
        rows.append(
            [
                name,
                len(runs),
                fmt(first),
                spread(runs, "first_step_s"),
                fmt(whole),
                spread(runs, "whole_s"),
                fmt(first / base if first and base else None, "x"),
                fmt(whole / base if whole and base else None, "x"),
            ]
        )
    head = ["variant", "runs", "first step (median)", "range", "whole (median)", "range"]
    head += ["first step / torch2", "whole / torch2"]
    out = [md_table(head, rows), ""]
    parts = [k for k in ("startup_s", "startup_launcher_s", "startup_import_s", "startup_rendezvous_s")]
    parts += ["startup_data_s", "startup_model_s", "startup_first_step_s"]
    measured = [
        [name, *(fmt(med(runs, k)) for k in parts)]
        for name, runs in results.items()
        if med(runs, "startup_s")
    ]
    if measured:
        out += [
            "What ddpkit measured itself (metrics.jsonl, median):",
            "",
            md_table(["variant", *parts], measured),
            "",
        ]
    out += ["Commands (TMP: a fresh temporary folder per run):"]
    out += [f"  {name}: {cmd}" for name, cmd in commands.items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7, help="rounds (each runs every variant once)")
    p.add_argument("--variants", nargs="+", default=["torch2", "after", "cold", "before"])
    p.add_argument("--baseline", default="a23812f", help="git revision for the `before` variant")
    p.add_argument("--demo", type=int, default=0, metavar="N", help="also time make demo's command N times")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args(argv)
    m = machine()
    print(f"start-up: {machine_line(m)}", flush=True)
    here = ROOT / "src"
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    shown = " ".join(TRAIN) + " out_dir=TMP"
    commands = {
        "torch2": 'python -c "import torch" & python -c "import torch"; wait',
        "step2": f'python -c "{STEP}" & python -c "{STEP}"; wait',
        "torchrun": f"python -m torch.distributed.run --standalone --nproc-per-node 2 plain_step.py ({PLAIN})",
        "after": f"PYTHONPATH=src python -m ddpkit {shown}",
        "cold": f"DDPKIT_WARM_START=0 PYTHONPATH=src python -m ddpkit {shown}",
        "before": f"PYTHONPATH=<git archive {args.baseline} src> python -m ddpkit {shown}",
    }
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_src(args.baseline, Path(tmp)) if "before" in args.variants else None
        runners = {
            "torch2": python_twice,
            "step2": lambda: python_twice(STEP),
            "torchrun": lambda: torchrun_plain(Path(tmp)),
            "after": lambda: ddpkit_run(here, TRAIN, env),
            "cold": lambda: ddpkit_run(here, TRAIN, {**env, "DDPKIT_WARM_START": "0"}),
            "before": lambda: ddpkit_run(old, TRAIN, env),  # type: ignore[arg-type]
        }
        for rep in range(args.reps):
            k = rep % len(args.variants)
            for name in args.variants[k:] + args.variants[:k]:
                r = runners[name]()
                results[name].append(r)
                print(
                    f"  round {rep + 1} {name}: "
                    + ", ".join(
                        f"{a} {fmt(b)}"
                        for a, b in r.items()
                        if b is not None and a in ("first_step_s", "whole_s")
                    ),
                    flush=True,
                )
    demo = []
    for _ in range(args.demo):
        r = ddpkit_run(here, DEMO, env)
        demo.append(r)
        print(
            f"  demo: start-up line {fmt(r['startup_line_s'])}, first progress line "
            f"{fmt(r['first_progress_line_s'])}, whole {fmt(r['whole_s'])}",
            flush=True,
        )
    print()
    print(f"Machine: {machine_line(m)}")
    print(
        f"Command: python benchmarks/startup.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    )
    print()
    print(report(results, commands))
    base = med(results.get("torch2", []), "whole_s")
    after = results.get("after", [])
    if base and after:
        first, whole = med(after, "first_step_s") / base, med(after, "whole_s") / base
        print()
        print(
            f"targets: first step <= {TARGET_FIRST}x torch2: {first:.2f}x, {'met' if first <= TARGET_FIRST else 'NOT met'}; "
            f"whole <= {TARGET_WHOLE}x: {whole:.2f}x, {'met' if whole <= TARGET_WHOLE else 'NOT met'}"
        )
    for name in ("step2", "torchrun"):
        other = med(results.get(name, []), "first_step_s" if name == "torchrun" else "whole_s")
        if other and after:
            print(f"first step / {name}: {med(after, 'first_step_s') / other:.2f}x")
    if demo:
        print()
        print(
            f"make demo's command (python -m ddpkit {' '.join(DEMO)} out_dir=TMP), {len(demo)} runs: start-up line "
            f"median {fmt(med(demo, 'startup_line_s'))}, first progress line {fmt(med(demo, 'first_progress_line_s'))}, "
            f"startup_s {fmt(med(demo, 'startup_s'))}, "
            f"whole {fmt(med(demo, 'whole_s'))}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": m, "results": results, "demo": demo, "commands": commands}, indent=1)
        )
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
