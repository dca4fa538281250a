"""Failures, measured: what a killed worker costs under --max-restarts, and how fast a stuck or dead rank ends a job.

Part 1, killed workers (the elastic restart path). A reference run trains without faults. Then each trial
starts the same run (2 processes, `--max-restarts 3`, a checkpoint every `--every-steps` optimizer steps),
waits until a random optimizer step has been logged, SIGKILLs one of the two workers (rank 0 and rank 1 in
turn) and measures:

  - restart time: from the kill until the restarted rank 0 says "resumed from ..." (the agent notices the
    death, stops the other worker, starts two new ones, they rendezvous, import, build and load),
  - first step after: from the kill until the first logged optimizer step of the new workers,
  - steps redone: the newest step logged before the kill minus the step of the checkpoint resumed from
    (work lost; at most --every-steps, plus the steps between logging and the kill),
  - extra wall time of the whole run over the reference,
  - whether the finished run equals the reference (every metrics.jsonl row, every weight, exactly once).

Part 2, a rank that stops (SIGSTOP, as a hung or swapped-out process) or dies without restarts (SIGKILL,
--max-restarts 0): the time from the signal until the first `ddpkit: error:` line and until the job has
exited non-zero, for several `dist.timeout_s`, and the error line that names the rank.

Part 3, two nodes (root: two network namespaces on a bridge, as the system tests build them), 2 nodes x 1
worker on a c10d rendezvous: node 1 dies (launcher and worker SIGKILLed) and is replaced, or is not; node 1's
link is down until both nodes have ended (a partition); node 1's link is down for 0.7 s (a blip). For each:
the seconds from the failure until it is noticed (the first error line), reported (the line that names the lost
node or peer), recovered (resumed) and until each node's launcher exits; and whether the run ends equal to an
unbroken one.

    python benchmarks/fault_recovery.py                       # 5 kill trials, timeouts 10 and 30 s, 3 node trials
    python benchmarks/fault_recovery.py --trials 10 --every-steps 20 --json out.json
    python benchmarks/fault_recovery.py --parts nodes --node-trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, machine_line, md_table, python, read_jsonl  # noqa: E402

# Digits, a small MLP, no augmentation: runs that must end bit-for-bit like the reference.
TRAIN = [
    "model.arch=mlp",
    "data.augment=false",
    "train.epochs=4",
    "train.batch_size=16",
    "train.log_every=1",
]
STEP = re.compile(r"== step: \[\s*(\d+)/(\d+)\] \[(\d+)/\d+\]")
RESUMED = re.compile(r"resumed from .*step (\d+)\)")


class Run:
    """`ddpkit train` in its own session; every output line kept with its time since launch.

    `argv` replaces `python -m ddpkit train out_dir=... TRAIN` (e.g. the same on a namespace "node"); `env`
    replaces this process's environment.
    """

    def __init__(
        self, out_dir: Path, *args: str, argv: list[str] | None = None, env: dict[str, str] | None = None
    ):
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv or [python(), "-m", "ddpkit", "train", f"out_dir={out_dir}", *TRAIN, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line.rstrip("\n")))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def steps(self, after: float = 0.0) -> list[tuple[float, int]]:
        """(time, global optimizer step) of every progress line logged after `after`."""
        out = []
        for t, line in list(self.lines):
            m = STEP.search(line)
            if m and t >= after:
                out.append((t, (int(m[3]) - 1) * int(m[2]) + int(m[1])))
        return out

    def first(self, pattern: re.Pattern, after: float) -> tuple[float, re.Match] | None:
        for t, line in list(self.lines):
            m = pattern.search(line)
            if m and t >= after:
                return t, m
        return None

    def workers(self) -> list[int]:
        """The launcher's worker processes (its fork server's children under a warm start), in start (= rank)
        order."""
        kids = _children(self.proc.pid)
        servers = [k for k in kids if _cmdline_has(k, b"multiprocessing.forkserver")]
        kids = [k for k in kids if k not in servers] + [w for s in servers for w in _children(s)]
        return sorted(k for k in kids if _cmdline_has(k, b"ddpkit"))

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self._reader.join(timeout=10)
        return rc

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def at(self, fragment: str) -> float | None:
        """The perf_counter() time of the first output line containing `fragment`."""
        return next((self.t0 + t for t, line in list(self.lines) if fragment in line), None)


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _cmdline_has(pid: int, word: bytes) -> bool:
    try:
        return word in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def wait_until(predicate, run: Run, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if run.proc.poll() is not None:
            raise SystemExit(f"the run ended early (exit {run.proc.returncode}):\n{run.text()[-3000:]}")
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting:\n{run.text()[-3000:]}")


def final(out_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    rows = read_jsonl(out_dir / "metrics.jsonl")
    state = torch.load(out_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return rows, state["model"]


def same_run(a, b) -> bool:
    (rows_a, model_a), (rows_b, model_b) = a, b
    keys = ("epoch", "train_loss", "train_acc1", "val_loss", "val_acc1", "lr")
    if [[r[k] for k in keys] for r in rows_a] != [[r[k] for k in keys] for r in rows_b]:
        return False
    return model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a)


def kill_trials(tmp: Path, trials: int, every: int, seed: int) -> tuple[float, list[dict[str, Any]]]:
    ref_dir = tmp / "reference"
    ref = Run(ref_dir, f"checkpoint.every_steps={every}", "--nproc-per-node", "2")
    if ref.wait(600) != 0:
        raise SystemExit(f"the reference run failed:\n{ref.text()[-3000:]}")
    ref_wall = ref.now()
    total = max(s for _, s in ref.steps())
    reference = final(ref_dir)
    print(f"  reference: {total} optimizer steps in {ref_wall:.1f} s", flush=True)

    rng = random.Random(seed)
    results = []
    for trial in range(trials):
        out = tmp / f"trial{trial}"
        target = rng.randint(5, total - 5)
        run = Run(out, f"checkpoint.every_steps={every}", "--nproc-per-node", "2", "--max-restarts", "3")
        wait_until(lambda r=run, s=target: any(step >= s for _, step in r.steps()), run)
        victims = run.workers()
        last_seen = max(s for _, s in run.steps())
        t_kill = run.now()
        rank = trial % len(victims)  # both ranks in turn: rank 0 also writes the checkpoints
        os.kill(victims[rank], signal.SIGKILL)
        rc = run.wait(600)
        resumed = run.first(RESUMED, t_kill)
        after = run.steps(t_kill)
        row = {
            "trial": trial,
            "killed_rank": rank,
            "killed_after_step": last_seen,
            "exit": rc,
            "resumed_from_step": int(resumed[1][1]) if resumed else None,
            "restart_s": round(resumed[0] - t_kill, 2) if resumed else None,
            "first_step_after_s": round(after[0][0] - t_kill, 2) if after else None,
            "steps_redone": last_seen - int(resumed[1][1]) if resumed else None,
            "extra_wall_s": round(run.now() - ref_wall, 2),
            "equals_reference": rc == 0 and same_run(reference, final(out)),
        }
        results.append(row)
        print(f"  trial {trial}: {row}", flush=True)
    return ref_wall, results


def stop_trials(tmp: Path, timeouts: list[int]) -> list[dict[str, Any]]:
    results = []
    cases = [("SIGSTOP", t, 0) for t in timeouts] + [("SIGKILL", timeouts[0], 0)]
    for sig_name, timeout_s, restarts in cases:
        out = tmp / f"{sig_name}-{timeout_s}"
        run = Run(
            out,
            "train.epochs=10000",
            f"dist.timeout_s={timeout_s}",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            str(restarts),
        )
        wait_until(lambda r=run: any(step >= 60 for _, step in r.steps()), run)
        time.sleep(1.5)  # a heartbeat carrying a recent step
        victim = run.workers()[1]
        t_sig = run.now()
        os.kill(victim, getattr(signal, sig_name))
        rc = run.wait(timeout_s + 300)
        errors = [(t, line) for t, line in run.lines if line.startswith("ddpkit: error:")]
        row = {
            "signal": f"{sig_name} rank 1",
            "dist.timeout_s": timeout_s,
            "exit": rc,
            "error_line_after_s": round(errors[0][0] - t_sig, 1) if errors else None,
            "exit_after_s": round(run.now() - t_sig, 1),
            "error": errors[0][1] if errors else "",
        }
        results.append(row)
        print(f"  {row}", flush=True)
    return results


# ------------------------------------------------------------------------------------------------ two nodes

# The system tests' small synthetic run, 12 epochs of 8 steps on 2 ranks, a checkpoint every 4 steps.
NODE_TRAIN_EXTRA = ["train.epochs=12", "train.log_every=1", "checkpoint.every_steps=4"]
NODE_CASES = ("node dies, replaced", "node dies", "partition", "blip")


def node_train(helpers) -> list[str]:
    return [*(t for t in helpers.TRAIN if not t.startswith("train.epochs=")), *NODE_TRAIN_EXTRA]


def _ended(runs: list[Run], limit: float) -> list[float]:
    """Poll until every run has exited (or `limit` s passed); the perf_counter() time each one ended."""
    ends: dict[int, float] = {}
    deadline = time.perf_counter() + limit
    while len(ends) < len(runs) and time.perf_counter() < deadline:
        for i, r in enumerate(runs):
            if i not in ends and r.proc.poll() is not None:
                ends[i] = time.perf_counter()
        time.sleep(0.05)
    return [ends.get(i, float("nan")) for i in range(len(runs))]


def node_case(pair, out: Path, case: str, port: int, timeout_s: int, rdzv_s: int, reference, helpers) -> dict:
    """One failure of a 2 nodes x 1 worker c10d job; the times from the failure, in seconds."""
    restarts = "2" if case.startswith("node dies") else "0"
    launch = helpers.c10d(
        pair.addrs[0], port, f"bench-{port}", 1, "--rdzv-timeout", str(rdzv_s), "--max-restarts", restarts
    )
    train = [
        python(),
        "-m",
        "ddpkit",
        "train",
        *node_train(helpers),
        f"dist.timeout_s={timeout_s}",
        f"out_dir={out}",
    ]

    def start(node: int) -> Run:
        return Run(out, argv=pair.argv(node, *train, *launch), env=pair.env())

    a, b = start(0), start(1)
    log = out / "log.txt"
    wait_until(lambda: (out / "checkpoints" / "last.pt").exists() and "[2/12]" in log.read_text(), a)
    t = time.perf_counter()
    row: dict[str, Any] = {"case": case}
    since = lambda at: round(at - t, 1) if at is not None else None  # noqa: E731
    if case.startswith("node dies"):
        helpers.kill_tree(b.proc.pid)  # node 1 dies: its launcher and its worker at once
        b.wait(30)
        if case.endswith("replaced"):
            time.sleep(1)
            b = start(1)
        end_a, end_b = _ended([a, b], 300)
        row.update(noticed_s=since(a.at("ddpkit: error: rank 0")), node0_exit_s=since(end_a))
        if case.endswith("replaced"):
            row.update(resumed_s=since(a.at("resumed from")))
        else:
            last = a.at("joined the rendezvous")
            row.update(reported_s=since(last), names_node=pair.hosts[1] in (a.text() if last else ""))
    elif case == "partition":
        pair.link(1, up=False)
        end_a, end_b = _ended([a, b], timeout_s + 120)
        pair.link(1, up=True)
        row.update(
            node0_error_s=since(a.at("ddpkit: error: rank 0")),
            node0_exit_s=since(end_a),
            node1_error_s=since(b.at("ddpkit: error: rank 1")),
            node1_exit_s=since(end_b),
            names_peers=f"rank 1 on {pair.hosts[1]}" in a.text() and pair.hosts[0] in b.text(),
        )
    else:  # blip
        pair.link(1, up=False)
        time.sleep(0.7)
        pair.link(1, up=True)
        _ended([a, b], 300)
    codes = (a.wait(60), b.wait(60))
    row["exits"] = f"{codes[0]}/{codes[1]}"
    if case in ("node dies, replaced", "blip"):
        row["equals_reference"] = codes == (0, 0) and same_run(reference, final(out))
    return row


def node_trials(tmp: Path, trials: int, timeout_s: int, rdzv_s: int) -> list[dict[str, Any]]:
    """Every NODE_CASES on two network namespaces joined by a bridge (needs root), `trials` times."""
    sys.path.insert(0, str(ROOT / "tests"))
    from system import helpers
    from system.infra import Session, make_pair, sweep

    sweep()
    session = Session.create()
    try:
        pair = make_pair(session)
        ref_dir = tmp / "node-reference"
        train = [
            python(),
            "-m",
            "ddpkit",
            "train",
            *node_train(helpers),
            f"out_dir={ref_dir}",
            "--nproc-per-node",
            "2",
        ]
        if Run(ref_dir, argv=train).wait(600) != 0:
            raise SystemExit("the 2-process reference run failed")
        reference = final(ref_dir)
        rows, port = [], 29600
        for trial in range(trials):
            for case in NODE_CASES:
                port += 1
                row = {
                    "trial": trial,
                    **node_case(pair, tmp / f"n{port}", case, port, timeout_s, rdzv_s, reference, helpers),
                }
                print(f"  {row}", flush=True)
                rows.append(row)
        return rows
    finally:
        session.cleanup()


def print_nodes(rows: list[dict[str, Any]], timeout_s: int, rdzv_s: int) -> None:
    print(
        f"\n### Two nodes x 1 worker, c10d, dist.timeout_s={timeout_s}, --rdzv-timeout {rdzv_s} (seconds after the failure)\n"
    )
    for case in NODE_CASES:
        mine = [r for r in rows if r["case"] == case]
        cols = [c for c in mine[0] if c != "case"] if mine else []
        print(f"{case}:\n")
        print(md_table(cols, [[r.get(c) for c in cols] for r in mine]) + "\n")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--every-steps", type=int, default=10)
    p.add_argument("--timeouts", type=int, nargs="+", default=[10, 30])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=["workers", "nodes"],
        default=["workers", "nodes"],
        help="what to measure",
    )
    p.add_argument("--node-trials", type=int, default=3, help="trials of every two-node case (needs root)")
    p.add_argument("--node-timeout", type=int, default=10, help="dist.timeout_s of the two-node runs")
    p.add_argument("--rdzv-timeout", type=int, default=20, help="--rdzv-timeout of the two-node runs")
    args = p.parse_args()
    m = machine()
    print(f"fault recovery: {machine_line(m)}", flush=True)
    ref_wall, kills, stops, nodes = 0.0, [], [], []
    signal.signal(
        signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt())
    )  # clean up namespaces
    with tempfile.TemporaryDirectory(prefix="ddpkit-faults-") as tmp:
        if "workers" in args.parts:
            ref_wall, kills = kill_trials(Path(tmp), args.trials, args.every_steps, args.seed)
            stops = stop_trials(Path(tmp), args.timeouts)
        if "nodes" in args.parts:
            nodes = node_trials(Path(tmp), args.node_trials, args.node_timeout, args.rdzv_timeout)
    if nodes:
        print_nodes(nodes, args.node_timeout, args.rdzv_timeout)
    if "workers" not in args.parts:
        if args.json:
            args.json.write_text(json.dumps({"machine": m, "nodes": nodes}))
        return 0 if all(r.get("equals_reference", True) for r in nodes) else 1

    print(f"\n### SIGKILL of a random worker, --max-restarts 3, checkpoint.every_steps={args.every_steps}\n")
    print(f"Reference run without faults: {ref_wall:.1f} s wall.\n")
    cols = [
        "trial",
        "killed_rank",
        "killed_after_step",
        "resumed_from_step",
        "steps_redone",
        "restart_s",
        "first_step_after_s",
        "extra_wall_s",
        "exit",
        "equals_reference",
    ]
    print(md_table(cols, [[r[c] for c in cols] for r in kills]))
    survived = sum(r["exit"] == 0 for r in kills)
    equal = sum(r["equals_reference"] for r in kills)
    print(f"\nsurvived {survived}/{len(kills)}; equal to the reference {equal}/{len(kills)}")
    print("\n### A rank that stops or dies\n")
    cols = ["signal", "dist.timeout_s", "exit", "error_line_after_s", "exit_after_s", "error"]
    print(md_table(cols, [[r[c] for c in cols] for r in stops]))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": m, "reference_wall_s": ref_wall, "kills": kills, "stops": stops, "nodes": nodes}
            )
        )
    return 0 if survived == equal == len(kills) else 1


if __name__ == "__main__":
    raise SystemExit(main())
