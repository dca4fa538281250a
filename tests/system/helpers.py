"""Small helpers shared by the system tests: the fast training settings and readers for what a run leaves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
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


def tail(text: str, chars: int = 3000) -> str:
    """The end of a long output, for assertion messages."""
    return text if len(text) <= chars else "..." + text[-chars:]


def ok(proc: subprocess.CompletedProcess) -> str:
    """Assert exit 0; the stdout."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{tail(proc.stdout)}\n--- stderr\n{tail(proc.stderr)}"
    )
    return proc.stdout


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
