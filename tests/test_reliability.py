"""Fault injection on real processes: killed workers, kills mid-save, corrupt checkpoints, stalls, SIGTERM."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import GPT_RUN, GPT_TEXT, assert_user_error, cli_env, finish, run_cli, start, wait_for
from ddpkit.checkpoint import load_checkpoint
from ddpkit.launcher.signals import worker_pids as workers
from ddpkit.train.metrics import read_metrics

# Deterministic runs: no augmentation, no norm/dropout layers, so a resumed run must equal an unbroken one.
EXACT = ["model.arch=mlp", "data.augment=false", "train.epochs=3"]
TRIALS = int(os.environ.get("DDPKIT_FAULT_TRIALS", "5"))


def final(out_dir) -> tuple[list[dict], dict]:
    return read_metrics(out_dir), load_checkpoint(Path(out_dir) / "checkpoints" / "last.pt")["model"]


def assert_same_run(a, b) -> None:
    rows_a, model_a = a
    rows_b, model_b = b
    assert [r["epoch"] for r in rows_b] == [r["epoch"] for r in rows_a]  # every epoch exactly once
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for key in ("train_loss", "train_acc1", "val_loss", "val_acc1", "val_acc5", "lr"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["epoch"], key)
    for k in model_a:
        torch.testing.assert_close(model_b[k], model_a[k], atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The reference: the same 2-process run with nothing going wrong."""
    out = tmp_path_factory.mktemp("unbroken") / "run"
    rc, _, err = finish(start(out, *EXACT, "checkpoint.every_steps=5", "--nproc-per-node", "2"))
    assert rc == 0, err[-3000:]
    return final(out)


def _kill_a_worker_once(out: Path, target, pick: int) -> tuple[bool, tuple[list[dict], dict]]:
    """One elastic run of EXACT on 2 workers, one of them SIGKILLed at `target` (see below) -> (whether a worker
    was really killed, the finished run)."""
    proc = start(out, *EXACT, "checkpoint.every_steps=5", "--nproc-per-node", "2", "--max-restarts", "3")
    try:
        if target == "start":
            wait_for(lambda: len(workers(proc.pid)) == 2, proc=proc)
        elif target == "checkpoint":
            wait_for(lambda: (out / "checkpoints" / "last.pt").exists(), proc=proc)
        else:
            wait_for(lambda: len(read_metrics(out)) >= target, proc=proc)
        victims = sorted(workers(proc.pid))
        if victims:
            os.kill(victims[pick % len(victims)], signal.SIGKILL)
        rc, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 0, f"{out.name}: {err[-3000:]}"
    return bool(victims), final(out)


@pytest.mark.slow
def test_sigkill_random_worker_then_elastic_restart_equals_unbroken(tmp_path, unbroken):
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(1234)
    # a random moment for each trial, chosen by progress and not by a clock (which a busy machine stretches past
    # the end of the run): as the workers start (no checkpoint yet), once the first mid-epoch checkpoint
    # (step 5) is written, or once epoch 1 or 2 of 3 is logged; and which worker
    trials = [(rng.choice(["start", "checkpoint", 1, 2]), rng.randrange(2)) for _ in range(TRIALS)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent jobs at a time
        runs = list(
            pool.map(lambda t: _kill_a_worker_once(tmp_path / f"trial{t}", *trials[t]), range(TRIALS))
        )
    for trial, (_, run) in enumerate(runs):
        try:
            assert_same_run(unbroken, run)
        except AssertionError as e:
            raise AssertionError(f"trial {trial} ({trials[trial][0]}): {e}") from None
    survived = sum(killed for killed, _ in runs)
    assert survived >= TRIALS - 1  # nearly every trial really lost a worker


@pytest.fixture(scope="module")
def two_epochs(finished_mlp):
    """A finished 2-epoch run of EXACT[:2] (curves off): the session's, conftest.finished_mlp, copied by each test."""
    return finished_mlp


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_last_checkpoint_falls_back_and_says_so(tmp_path, two_epochs, damage):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_epochs, out)
    last = out / "checkpoints" / "last.pt"
    data = last.read_bytes()
    with open(last, "r+b") as fh:  # damaged in place, as another tool would
        fh.truncate(0)
        fh.write({"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(4096)}[damage])
    assert load_checkpoint(out / "checkpoints" / "epoch_0002.pt")["epoch"] == 2  # a copy, not a link: intact
    rc, stdout, err = finish(start(out, *EXACT[:2], "train.epochs=3"))
    assert rc == 0, err
    assert "warning" in stdout and "last.pt" in stdout and "falling back" in stdout
    assert "resumed from" in stdout and "epoch_0002.pt" in stdout
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2, 3]
    assert load_checkpoint(last)["epoch"] == 3


@pytest.mark.slow
def test_stopped_rank_ends_the_job_and_is_named(tmp_path):
    timeout_s = 6
    out = tmp_path / "run"
    proc = start(
        out, "model.arch=mlp", "train.epochs=200", f"dist.timeout_s={timeout_s}", "--nproc-per-node", "2"
    )
    wait_for(lambda: len(read_metrics(out)) >= 1, proc=proc)
    time.sleep(1.5)  # let the heartbeats carry a step number
    victim = sorted(workers(proc.pid))[1]  # workers start in rank order
    t0 = time.time()
    os.kill(victim, signal.SIGSTOP)
    rc, _, err = finish(proc, timeout=timeout_s + 120)
    elapsed = time.time() - t0
    assert rc != 0
    # The collective timeout, then the end: the launcher continues the stopped rank once torch's agent has
    # sent it SIGTERM, so it acts on it at once. Before, the agent waited out its 30 s grace for the stopped
    # rank before SIGKILLing it (the job ended 36-40 s after the SIGSTOP).
    assert elapsed < timeout_s + 20, elapsed
    lines = [ln for ln in err.splitlines() if ln.startswith("ddpkit: error:")]
    assert any("stopped responding: rank 1" in ln and "at step" in ln for ln in lines), err[-3000:]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of `rank` of the job `launcher` started, from its job folder (diagnostics/stacks.py)."""
    import tempfile

    for path in Path(tempfile.gettempdir()).glob(f"ddpkit-job-{launcher}-*/rank{rank}.pid"):
        return int(path.read_text().split()[0])
    return None


def _kill_rank_mid_run(out: Path, nproc: int, rank: int, tp: int, env: dict) -> tuple[int, str]:
    """A 3-D GPT (pipeline of 2 stages, fsdp, tp) on `nproc` processes, `rank` SIGKILLed once it has trained
    a step -> (exit status, stderr)."""
    corpus = out.parent / "corpus.txt"
    corpus.write_text(GPT_TEXT)
    layout = ["dist.strategy=fsdp", f"dist.tp={tp}", "dist.pp=2", "train.epochs=100", "--oversubscribe"]
    proc = start(out, *GPT_RUN, f"data.root={corpus}", *layout, "--nproc-per-node", str(nproc), env=env)
    try:
        wait_for(
            lambda: "step" in ((out / "log.txt").read_text() if (out / "log.txt").exists() else ""), proc=proc
        )
        wait_for(lambda: _rank_pid(proc.pid, rank) is not None, proc=proc)
        os.kill(_rank_pid(proc.pid, rank), signal.SIGKILL)
        rc, _, err = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, err


@pytest.mark.slow
def test_a_dead_rank_is_named_first_and_the_others_errors_go_to_log_txt(tmp_path):
    # The case is 8 ranks (fsdp x tp2 x pp2); 4 warm ranks (tp2 x pp2) and 2 cold ones (pp2) show the
    # same: before, the job's lines named a rank that gave up waiting ("rank 3 gave up ... Connection reset by
    # peer"), one per rank (warm), and the pipeline's wrapped errors came as tracebacks (cold: 116 lines).
    from concurrent.futures import ThreadPoolExecutor

    runs = [
        (tmp_path / "warm" / "run", 4, 2, 2, {}),
        (tmp_path / "cold" / "run", 2, 1, 1, {"DDPKIT_WARM_START": "0"}),
    ]
    for out, *_ in runs:
        out.parent.mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        ended = list(pool.map(lambda run: _kill_rank_mid_run(*run), runs))
    for (out, _, rank, _, _), (rc, err) in zip(runs, ended, strict=True):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 1 and len(lines) == 1, err[-4000:]
        assert re.match(rf"ddpkit: error: rank {rank} was killed by SIGKILL at step \d+; then ", lines[0]), (
            lines
        )
        assert "the errors of the ranks that waited for it are in log.txt" in lines[0]
        assert re.search(r"rank \d gave up on a collective at step \d+", (out / "log.txt").read_text())


@pytest.mark.slow
def test_sigterm_mid_epoch_checkpoints_this_step_and_resumes_exactly(tmp_path):
    args = [
        "model.arch=mlp",
        "data.augment=false",
        "train.epochs=2",
        "train.batch_size=4",
        "train.log_every=20",
    ]
    ref = tmp_path / "ref"
    unbroken = start(ref, *args)  # beside the run that is stopped
    try:
        out = tmp_path / "run"
        proc = start(out, *args)
        log = out / "log.txt"
        wait_for(lambda: log.exists() and "[2/2]" in log.read_text(), proc=proc)  # inside epoch 2 (359 steps)
        os.kill(proc.pid, signal.SIGTERM)
        rc, _, err = finish(proc)
        assert rc == 3, err  # the documented preemption exit code
        assert "stopped by SIGTERM at step" in err
        state = load_checkpoint(out / "checkpoints" / "last.pt")
        assert state["epoch"] == 1 and 0 < state["consumed"] < 1438
        rc, stdout, err = finish(start(out, *args))
        assert rc == 0, err
        assert "samples into epoch 2" in stdout
        rc, _, err = finish(unbroken)
        assert rc == 0, err
    finally:
        if unbroken.poll() is None:
            os.killpg(unbroken.pid, signal.SIGKILL)
            unbroken.wait()
    assert_same_run(final(ref), final(out))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_all_workers_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = ["model.arch=mlp", "data.augment=false", "train.epochs=50", "--nproc-per-node", "2"]
    proc = start(out, *args)
    wait_for(lambda: len(read_metrics(out)) >= 1, proc=proc)
    os.kill(proc.pid, signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 3, err[-3000:]
    state = load_checkpoint(out / "checkpoints" / "last.pt")
    assert state["step"] >= 1438 // 128  # at least the first epoch: global batches of 2 x 64
    assert len(read_metrics(out)) == state["epoch"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_three_ranks_uneven_sizes_never_hang(tmp_path, strategy):
    out = tmp_path / strategy
    rc, _, err = finish(
        start(
            out,
            "data.dataset=synthetic",
            "data.synthetic_size=1001",
            "data.synthetic_val_size=7",
            "data.image_size=8",
            "model.arch=mlp",
            "train.batch_size=10",
            "train.epochs=2",
            "eval.batch_size=2",
            f"dist.strategy={strategy}",
            "--nproc-per-node",
            "3",
        ),
        timeout=240,
    )
    assert rc == 0, err[-3000:]
    rows = read_metrics(out)
    assert [r["val_samples"] for r in rows] == [7, 7]
    assert rows[-1]["step"] == 2 * (1001 // 30)


def test_nonfinite_loss_stops_naming_step_and_ranks(tmp_path):
    proc = run_cli(
        "train", f"out_dir={tmp_path / 'run'}", "model.arch=mlp", "optim.lr=1e12", "train.epochs=1"
    )
    # a training failure, not a user input error: exit 1, one line naming the rank and the step, no traceback
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "non-finite loss on rank 0 by step " in errors[0] and "train.nonfinite=skip" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained on garbage was saved


NONFINITE = ("train", "model.arch=mlp", "optim.lr=1e12", "train.epochs=1")  # a loss that turns NaN


@pytest.mark.slow
def test_nonfinite_loss_in_a_launched_job_exits_1_naming_the_ranks(tmp_path):
    proc = run_cli(*NONFINITE, f"out_dir={tmp_path / 'run'}", "--nproc-per-node", "2")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "ddpkit: error: non-finite loss on rank 0, 1 by step " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_nonfinite_skip_drops_the_step(tmp_path):
    proc = run_cli(*NONFINITE, f"out_dir={tmp_path / 'run'}", "train.nonfinite=skip")
    assert proc.returncode == 0, proc.stderr
    assert "step skipped" in proc.stdout


def test_checkpoint_files_refuse_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": Evil()}, path)
    proc = run_cli("eval", f"checkpoint.path={path}")
    assert_user_error(proc, "unreadable")
    assert not (tmp_path / "pwned").exists()


RESTART_SCRIPT = r"""
import os, sys, time
import torch, torch.distributed as dist
import ddpkit

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(4)  # the replacement of rank 1 comes late: rank 0 must not take its predecessor's address
ddpkit.init_distributed(timeout_s=20)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
if attempt == 0:
    dist.barrier()
    if rank == 1:
        os._exit(1)  # a worker dies; the agent restarts both
    time.sleep(60)
sys.stdout.write(f"attempt {attempt} rank {rank} sum {t.item():g}\n")  # one write: the ranks share a pipe
sys.stdout.flush()
ddpkit.shutdown()
"""


@pytest.mark.slow
def test_restarted_workers_never_see_the_dead_workers_rendezvous_keys(tmp_path):
    # torch's agent hands the same store to every restart round; without a per-attempt view of it the late
    # replacement's peer reads the dead worker's gloo address and hangs until the timeout.
    script = tmp_path / "restart.py"
    script.write_text(RESTART_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    t0 = time.time()
    proc = subprocess.run(
        [*cmd, "--max-restarts", "1", str(script)], capture_output=True, text=True, env=cli_env(), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n")[:-1]) == ["attempt 1 rank 0 sum 3", "attempt 1 rank 1 sum 3"]
    assert time.time() - t0 < 60


def test_every_test_the_reliability_table_names_exists():
    import ast

    from conftest import REPO

    text = (REPO / "docs" / "reliability.md").read_text()
    table = text.split("## What each bad input gets, and the test that holds it\n", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", table)
    assert len(named) >= 30
    for file, name in named:
        (path,) = (REPO / "tests").rglob(file)  # test files sit in folders that mirror the package
        tree = ast.parse(path.read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{file}::{name}"
