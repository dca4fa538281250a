"""Signals through ddpkit's own launcher (real processes): SIGTERM, SIGUSR1 and SIGINT to the launcher or to one
worker stop every rank at the same step with a checkpoint (exit 3); a launcher killed with SIGKILL leaves no
worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, finish, start, wait_for, within
from ddpkit.checkpoint import load_checkpoint
from ddpkit.launcher.signals import worker_pids
from ddpkit.train.metrics import read_metrics

# 2 epochs of 179 optimizer steps on 2 ranks: the signal comes once epoch 1 is logged.
ARGS = ["model.arch=mlp", "data.augment=false", "train.epochs=2", "train.batch_size=4", "train.log_every=50"]


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its parent to read its status does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_run(out: Path, sig: signal.Signals, target: str, launcher: str) -> tuple[int, str]:
    """Start 2 workers, send `sig` to the launcher or to worker rank 1 once epoch 1 is logged; (exit, stderr)."""
    proc = start(out, *ARGS, "--nproc-per-node", "2", "--launcher", launcher)
    wait_for(lambda: len(read_metrics(out)) >= 1, proc=proc)
    pids = sorted(worker_pids(proc.pid))
    assert len(pids) == 2, pids
    os.kill(proc.pid if target == "parent" else pids[1], sig)
    rc, _, err = finish(proc, timeout=120)
    assert not [p for p in pids if alive(p)]
    return rc, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, target, launcher",
    [
        (signal.SIGUSR1, "parent", "torchrun"),  # this one also reruns the command
        (signal.SIGTERM, "parent", "torchrun"),
        (signal.SIGINT, "parent", "torchrun"),
        (signal.SIGUSR1, "worker", "torchrun"),
        (signal.SIGTERM, "worker", "torchrun"),
        (signal.SIGINT, "worker", "torchrun"),
        (signal.SIGUSR1, "parent", "spawn"),
        (signal.SIGINT, "worker", "spawn"),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_signal_stops_every_rank_with_a_checkpoint_and_exit_3(tmp_path, sig, target, launcher):
    out = tmp_path / "run"
    rc, err = stop_run(out, sig, target, launcher)
    assert rc == 3, err[-3000:]
    assert "stopped by SIG" in err and "ddpkit: error" not in err and "exitcode" not in err, err[-3000:]
    state = load_checkpoint(out / "checkpoints" / "last.pt")
    # the step it stopped at: the end of epoch 1 (the signal came before the agreement there) or inside epoch 2
    assert state["epoch"] == 1 and 179 <= state["step"] < 358
    if (sig, target, launcher) != (signal.SIGUSR1, "parent", "torchrun"):
        return
    rc, _, err = finish(start(out, *ARGS, "--nproc-per-node", "2"))
    assert rc == 0, err[-3000:]
    assert "resumed from" in (out / "log.txt").read_text()
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2]


PID_SCRIPT = """\
import os, signal, sys, time
if len(sys.argv) > 2:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(sys.argv[2])))
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
while True:
    time.sleep(0.1)
"""


def start_quiet(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: orphaned workers would hold a pipe open
        return subprocess.Popen(
            [sys.executable, "-m", "ddpkit", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=cli_env(env),
            start_new_session=True,
        )


def descendants(pid: int) -> list[int]:
    """Every process below pid (workers, the fork server, their helpers)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def script_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`ddpkit run --nproc-per-node 2 PID_SCRIPT`, once both workers have written their pid."""
    (tmp_path / "pids").mkdir()
    (tmp_path / "s.py").write_text(PID_SCRIPT)
    args = ["run", "--nproc-per-node", "2", str(tmp_path / "s.py"), str(tmp_path / "pids"), *extra]
    proc = start_quiet(args, tmp_path / "log")
    wait_for(lambda: len(list((tmp_path / "pids").iterdir())) == 2, proc=proc)
    return proc, tmp_path / "log"


@pytest.mark.slow
@pytest.mark.parametrize("what", ["train", "train-cold", "train-spawn", "run"])
def test_sigkill_of_the_launcher_leaves_no_worker_alive(tmp_path, what):
    if what == "run":
        proc, log = script_run(tmp_path)
    else:
        out = tmp_path / "run"
        args = ["train", f"out_dir={out}", *ARGS[:-2], "train.epochs=50", "--nproc-per-node", "2"]
        proc = start_quiet(
            args + (["--launcher", "spawn"] if what == "train-spawn" else []), tmp_path / "log"
        )
        wait_for(lambda: len(read_metrics(out)) >= 1, proc=proc)
    below = descendants(proc.pid)
    assert len(worker_pids(proc.pid)) == 2, (below, log.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    within(5, lambda: not any(alive(p) for p in below))
    left = [p for p in below if alive(p)]
    for p in left:  # do not leave them running after a failed check
        os.kill(p, signal.SIGKILL)
    assert not left, f"still alive 5 s after the launcher was killed: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("handler_exit, expected", [(None, 128 + signal.SIGTERM), ("7", 7)])
def test_ddpkit_run_passes_a_signal_on_and_exits_with_the_workers_status(tmp_path, handler_exit, expected):
    proc, log = script_run(tmp_path, *([handler_exit] if handler_exit else []))
    workers = worker_pids(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == expected, log.read_text()[-3000:]
    assert not [p for p in workers if alive(p)]


@pytest.mark.slow
def test_a_second_sigint_to_the_launcher_kills_the_workers_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start(out, *ARGS[:-2], "train.epochs=50", "--nproc-per-node", "2")
    wait_for(lambda: len(read_metrics(out)) >= 1, proc=proc)
    below = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    rc, _, err = finish(proc, timeout=60)
    assert rc == 130 and "ddpkit: interrupted" in err, err[-3000:]
    assert within(1, lambda: not [p for p in below if alive(p)])


AFTER_A_LAUNCH = r"""
import os, subprocess, sys
from ddpkit.cli import run
from ddpkit.launcher.signals import PARENT_VAR

assert run(["info", "--nproc-per-node", "2"]) == 0  # this process launched workers itself
assert PARENT_VAR not in os.environ, "the launcher's mark outlived its launch"
# A program this process starts later, through a shell (as srun or nsenter would), is nobody's worker.
shell = subprocess.run(["sh", "-c", f"{sys.executable} -m ddpkit info"], capture_output=True, text=True)
assert shell.returncode == 0, (shell.returncode, shell.stderr[-500:])
print("SHELL", shell.stdout.strip(), flush=True)
from ddpkit.cli import main
print("AGAIN", flush=True)
main(["info"])  # and the command line called in this process again
"""


@pytest.mark.slow
def test_a_process_that_launched_once_is_nobodys_worker_afterwards(tmp_path):
    # Before: the launcher's pid stayed in its environment, so a later `ddpkit` started through a shell (or
    # cli.main in the same process) took itself for an orphaned worker and exited 137 at once.
    proc = subprocess.run(
        [sys.executable, "-c", AFTER_A_LAUNCH], capture_output=True, text=True, env=cli_env(), timeout=300
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    out = proc.stdout.splitlines()
    launched = [ln for ln in out[: out.index("AGAIN")] if ln.startswith("rank=")]
    assert [ln.split()[:3] for ln in launched] == [
        ["rank=0", "local_rank=0", "world_size=2"],
        ["rank=1", "local_rank=1", "world_size=2"],
    ]
    shell = next(ln for ln in out if ln.startswith("SHELL "))  # one process of its own: not a worker of ours
    assert shell.split()[1:4] == ["rank=0", "local_rank=0", "world_size=1"] and "launcher=none" in shell
    again = out[out.index("AGAIN") + 1 :]
    assert len(again) == 1 and again[0].split()[:3] == ["rank=0", "local_rank=0", "world_size=1"], again
