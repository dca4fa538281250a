"""Small helpers shared by the system tests: the fast training settings, readers for what a run leaves, and
processes watched line by line (and killed as a whole tree, as a node dies)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

PY = sys.executable
# One epoch of a small MLP on synthetic data: a few seconds, and the same batches for any launcher.
TRAIN = [
    "train.epochs=1",
    "data.dataset=synthetic",
    "data.synthetic_size=256",
    "data.synthetic_val_size=64",
    "model.arch=mlp",
    "train.batch_size=16",
    "seed=7",
]
INFO = re.compile(r"^rank=\d+ .*$", re.M)


def c10d(addr: str, port: int, rdzv_id: str, nproc: int = 1, *extra: str) -> list[str]:
    """Launch flags of a 2-node c10d rendezvous at ADDR:PORT."""
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-endpoint",
        f"{addr}:{port}",
        "--rdzv-id",
        rdzv_id,
        *extra,
    ]


def tail(text: str, chars: int = 3000) -> str:
    """The end of a long output, for assertion messages."""
    return text if len(text) <= chars else "..." + text[-chars:]


def ok(proc: subprocess.CompletedProcess) -> str:
    """Assert exit 0; the stdout."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{tail(proc.stdout)}\n--- stderr\n{tail(proc.stderr)}"
    )
    return proc.stdout


def all_ok(results: list[subprocess.CompletedProcess]) -> list[str]:
    """Assert every process exited 0, showing the output of each one that did not (a node's failure often
    shows only as 'connection closed by peer' on the other); their stdouts."""
    bad = [(i, r) for i, r in enumerate(results) if r.returncode != 0]
    assert not bad, "\n".join(
        f"=== process {i}: exit {r.returncode}\n--- stdout\n{tail(r.stdout)}\n--- stderr\n{tail(r.stderr)}"
        for i, r in bad
    )
    return [r.stdout for r in results]


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Wait for started processes (text pipes); their results. Kills them all if one hangs."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def rank_lines(stdout: str) -> list[dict[str, str]]:
    """`ddpkit info` lines as {field: value}, in printed order."""
    return [dict(tok.split("=", 1) for tok in line.split()) for line in INFO.findall(stdout)]


def metrics(out_dir: Path) -> list[dict]:
    """metrics.jsonl rows."""
    return [
        json.loads(line)
        for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def assert_trained(out_dir: Path, world_size: int) -> None:
    """One finished epoch by one job of `world_size` ranks, with its checkpoint."""
    rows = metrics(out_dir)
    assert [r["epoch"] for r in rows] == [1], rows
    assert rows[0]["world_size"] == world_size, rows
    assert rows[0]["val_samples"] == 64, rows
    assert (Path(out_dir) / "checkpoints" / "last.pt").is_file()


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The model state_dict of checkpoints/last.pt."""
    return torch.load(Path(out_dir) / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)[
        "model"
    ]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo += children.get(p, [])
    return found


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and all its descendants at once (a node that dies: its launcher and its workers)."""
    tree = descendants(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


class Timed:
    """A started process whose output lines are kept with the time they arrived (seconds since `t0`)."""

    def __init__(self, proc: subprocess.Popen, t0: float):
        self.proc, self.t0 = proc, t0
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None
        self._readers = [
            threading.Thread(target=self._read, args=(pipe,), daemon=True)
            for pipe in (proc.stdout, proc.stderr)
        ]
        for r in self._readers:
            r.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        """The exit code; kills the process tree when it is not done within `timeout`."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            code = self.proc.wait()
        self.ended = self.ended or time.monotonic() - self.t0
        for r in self._readers:
            r.join(timeout=10)
        return code

    def poll_ended(self) -> bool:
        """True once the process has exited (and records when)."""
        if self.proc.poll() is not None and self.ended is None:
            self.ended = time.monotonic() - self.t0
        return self.proc.poll() is not None

    def first(self, fragment: str) -> tuple[float, str] | None:
        """(time, line) of the first output line containing `fragment`."""
        return next(((t, line) for t, line in list(self.lines) if fragment in line), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)
