"""One run per out_dir (ddpkit.train.rundir, ddpkit.train.runlock): the lock, what an earlier run left there (continued, refused
or moved aside, never overwritten), every check before the first byte, and the OS failures of writing a run
(a full or read-only disk, a path under a file, a closed stdout) in one line."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import QUICK_MLP, assert_user_error, cli_env, run_cli, wait_for
from ddpkit.checkpoint import CheckpointDir, load_checkpoint
from ddpkit.config import load_config
from ddpkit.errors import UserError
from ddpkit.train.metrics import read_metrics
from ddpkit.train.rundir import Plan, decide, inspect
from ddpkit.train.runlock import LOCK_NAME, RunLock, check_free, job_id

QUICK = QUICK_MLP


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes): what "nothing changed" compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(finished_mlp) -> Path:
    """A real 2-epoch run of QUICK (the session's, conftest.finished_mlp), copied by each test that needs an
    earlier run in its out_dir."""
    return finished_mlp


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# ---------------------------------------------------------------------------------------------------- the lock


def test_the_lock_is_exclusive_names_its_holder_and_goes_back_to_what_it_was(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    assert first.acquire() == {}
    with pytest.raises(UserError) as e:
        second.acquire(wait_s=0)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in e.value.what and "in use" in e.value.what
    with pytest.raises(UserError, match="in use by another ddpkit train"):
        check_free(tmp_path)  # the launcher's test
    held = (tmp_path / LOCK_NAME).read_bytes()
    first.release()
    check_free(tmp_path)
    assert second.acquire()["pid"] == os.getpid()  # what the previous holder wrote
    second.release(undo=True)  # a run that failed its checks leaves the file as it found it
    assert (tmp_path / LOCK_NAME).read_bytes() == held
    fresh = RunLock(tmp_path / "new")
    (tmp_path / "new").mkdir()
    fresh.acquire()
    fresh.release(undo=True)
    assert not (tmp_path / "new" / LOCK_NAME).exists()


HOLDER = r"""
import sys, time
from ddpkit.train.runlock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_killed_holder_never_blocks_the_next_run(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=cli_env()
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {proc.pid} "):
            RunLock(tmp_path).acquire(wait_s=0)
    finally:
        proc.kill()
        proc.wait()
    lock = RunLock(tmp_path)
    assert lock.acquire(wait_s=0)["pid"] == proc.pid  # the kernel let go when the process died
    lock.release()


def test_a_forked_child_such_as_a_loader_worker_does_not_keep_the_lock(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # a DataLoader worker forked while the run holds the lock
        os.write(ready_w, b"x")  # os.fork() returned here: the at-fork hooks have run
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        lock.release()
        again = RunLock(tmp_path)
        again.acquire(wait_s=0)  # the child is alive, but it closed its copy of the lock at fork
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# ------------------------------------------------------------------------------------- what to do with out_dir


def fake_run(out: Path, epochs: int = 2) -> CheckpointDir:
    """An earlier run's files without training: epoch checkpoints, last.pt, metrics lines, config and log."""
    ckpt = CheckpointDir(out)
    for e in range(1, epochs + 1):
        state = {"model": {"w": torch.full((2,), float(e))}, "epoch": e, "step": 10 * e, "consumed": 0}
        ckpt.save_epoch(state, e, is_best=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in range(1, epochs + 1)))
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "log.txt").write_text("earlier\n")
    return ckpt


def plan(out: Path, *overrides: str, same_job: bool = False, warnings: list | None = None) -> Plan | None:
    cfg = load_config(None, [f"out_dir={out}", *overrides])
    return decide(cfg, inspect(out), same_job, (warnings if warnings is not None else []).append)


def test_an_earlier_run_is_continued_or_refused_never_started_over(tmp_path):
    out = tmp_path / "run"
    assert plan(out) == Plan(None)  # nothing there: afresh
    ckpt = fake_run(out)
    assert plan(out) == Plan(str(ckpt.last))  # resume=auto continues it
    with pytest.raises(UserError, match=r"holds an earlier run \(epochs 1-2 in metrics.jsonl, 4 checkpoint"):
        plan(out, "checkpoint.resume=none")
    assert plan(out, "checkpoint.resume=none", "checkpoint.overwrite=true") == Plan(None, move_aside=True)
    assert plan(out, f"checkpoint.resume={ckpt.last}") == Plan(str(ckpt.last))  # where it stands: continued
    older = ckpt.epoch_path(1)
    with pytest.raises(UserError, match="would replace that run's later checkpoints and metrics"):
        plan(out, f"checkpoint.resume={older}")
    assert plan(out, f"checkpoint.resume={older}", "checkpoint.overwrite=true") == Plan(str(older), True)
    # the launcher decides what it can without reading a checkpoint
    cfg = load_config(None, [f"out_dir={out}"])
    assert decide(cfg, inspect(out), False, warn=None) is None


def test_no_readable_checkpoint_is_refused_listing_them(tmp_path):
    out = tmp_path / "run"
    ckpt = fake_run(out)
    ckpt.last.write_bytes(b"torn")
    warnings: list[str] = []
    assert plan(out, warnings=warnings) == Plan(str(ckpt.epoch_path(2)))  # one broken: the next one, said
    assert len(warnings) == 1 and "last.pt" in warnings[0]
    for p in ckpt.epoch_files():
        p.write_bytes(b"")
    with pytest.raises(UserError) as e:
        plan(out)
    assert "no checkpoint of the run" in e.value.what
    assert all(name in e.value.what for name in ("last.pt", "epoch_0002.pt", "epoch_0001.pt"))
    assert "checkpoint.overwrite=true" in e.value.hint and "previous" in e.value.hint
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(UserError, match="but no checkpoint to continue it from"):
        plan(out)


def test_a_restart_of_the_same_job_carries_on_whatever_resume_and_overwrite_say(tmp_path):
    out = tmp_path / "run"
    ckpt = fake_run(out)
    args = ("checkpoint.resume=none", "checkpoint.overwrite=true")
    assert plan(out, *args, same_job=True) == Plan(str(ckpt.last))
    assert plan(out, *args, same_job=False) == Plan(None, move_aside=True)


def test_job_ids_name_a_job_across_its_restarts(monkeypatch):
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    assert job_id() is None  # a plain process
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not unique, the agent is
    assert job_id() == f"agent:{socket.gethostname()}:{os.getppid()}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5f0c")
    assert job_id() == "elastic:5f0c"
    monkeypatch.setenv("SLURM_JOB_ID", "812")  # a requeued Slurm job keeps its id
    assert job_id() == "slurm:812"


def test_a_config_yaml_no_run_wrote_is_not_replaced(tmp_path):
    own = tmp_path / "config.yaml"
    own.write_text("# my settings\ntrain:\n  epochs: 1\n")
    proc = run_cli("train", "-c", str(own), f"out_dir={tmp_path}", *QUICK)
    assert_user_error(proc, "holds a config.yaml that no ddpkit run wrote")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert own.read_text().startswith("# my settings")


# ------------------------------------------------------------------------- the command line, on real runs


def test_resume_none_on_an_earlier_run_is_refused_and_changes_nothing(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    before = tree(out)
    proc = run_cli("train", f"out_dir={out}", *QUICK, "train.epochs=3", "checkpoint.resume=none")
    assert_user_error(proc, "holds an earlier run", "checkpoint.resume=none", "checkpoint.overwrite=true")
    assert tree(out) == before


def test_every_checkpoint_unreadable_is_refused_listing_them(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    for p in (out / "checkpoints").iterdir():
        p.write_bytes(p.read_bytes()[:100])
    before = tree(out)
    proc = run_cli("train", f"out_dir={out}", *QUICK, "train.epochs=3")
    line = assert_user_error(proc, "no checkpoint of the run", "last.pt", "epoch_0002.pt", "epoch_0001.pt")
    assert "truncated or damaged" in line
    assert tree(out) == before  # no restart from scratch over the broken files, no epochs 1 2 after 1 2


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("bad", ["unreadable", "unfitting"])
def test_a_resume_that_cannot_work_fails_before_config_yaml_is_rewritten(finished, tmp_path, bad):
    out = copy_of(finished, tmp_path)
    args = ["train.epochs=3", "train.batch_size=16"]  # a changed config: config.yaml would differ
    if bad == "unreadable":
        torch.save({"model": {}, "epoch": 1, "step": 1, "x": Evil()}, tmp_path / "evil.pt")
        args += [f"checkpoint.resume={tmp_path / 'evil.pt'}"]
        fragments = ("evil.pt", "GLOBAL posix.system", "a safe load refuses to run")
    else:
        args += ["model.arch=cnn"]  # the run's checkpoints hold an MLP
        fragments = ("does not fit this model", "model.arch=cnn")
    before = tree(out)
    proc = run_cli("train", f"out_dir={out}", "data.augment=false", "report.curves=false", *args)
    line = assert_user_error(proc, *fragments)
    assert "weights_only" not in line
    assert tree(out) == before


def test_overwrite_moves_the_earlier_run_aside_and_starts_anew(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    before = tree(out)
    proc = run_cli("train", f"out_dir={out}", *QUICK, "train.epochs=1", "checkpoint.overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (moved,) = list((out / "previous").iterdir())
    assert f"was moved to {moved}" in proc.stdout
    kept = tree(moved)
    assert kept == {k: v for k, v in before.items() if k != LOCK_NAME}  # every byte kept, nothing deleted
    assert [r["epoch"] for r in read_metrics(out)] == [1]
    assert load_checkpoint(out / "checkpoints" / "last.pt")["epoch"] == 1


@pytest.mark.slow
def test_two_runs_started_at_once_one_trains_and_the_other_exits_2_naming_it(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddpkit", "train", f"out_dir={out}", *QUICK, "train.epochs=3"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
        for _ in range(2)
    ]
    # Whichever takes the lock first is held still (SIGSTOP) until the other has met the lock: on a busy
    # machine the second could otherwise start only after the first had finished, and then rightly continue it.
    pids = {p.pid: p for p in procs}
    wait_for(lambda: lock_holder(out) in pids or any(p.poll() is not None for p in procs))
    first = pids.get(lock_holder(out))
    if first is not None and first.poll() is None:
        os.kill(first.pid, signal.SIGSTOP)
        try:
            (other,) = [p for p in procs if p is not first]
            other.wait(timeout=300)
        finally:
            os.kill(first.pid, signal.SIGCONT)
    results = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [(p.returncode, err[-1500:]) for p, _, err in results]
    (winner,) = [p for p, _, _ in results if p.returncode == 0]
    (loser,) = [(p, err) for p, _, err in results if p.returncode == 2]
    line = assert_user_error(subprocess.CompletedProcess([], 2, "", loser[1]), "is in use by another")
    assert f"pid {winner.pid} on host {socket.gethostname()}" in line
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2, 3]  # one writer: no 1 1 2 2 3 3


def lock_holder(out: Path) -> int | None:
    try:
        return json.loads((out / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_a_second_launch_fails_before_starting_workers(tmp_path):
    out = tmp_path / "run"
    args = ["train", f"out_dir={out}", *QUICK, "train.epochs=200", "--nproc-per-node", "2"]
    first = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(),
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not (lock_holder(out) and read_metrics(out)) and time.time() < deadline:
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        holder = lock_holder(out)
        second = run_cli(*args, timeout=120)
        line = assert_user_error(second, "is in use by another ddpkit train", f"pid {holder} ")
        assert "local_rank" not in second.stderr  # refused by the launcher: no worker was started
        assert line and first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.slow
def test_a_restart_after_the_lock_holder_is_killed_takes_its_own_run_over(finished, tmp_path):
    # resume=none and overwrite=true: the job moves the earlier run aside once; its restart continues its own
    # run (same job) instead of being refused or moving that aside too.
    out = copy_of(finished, tmp_path)
    args = [*QUICK, "train.epochs=4", "checkpoint.resume=none", "checkpoint.overwrite=true"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", f"out_dir={out}", *args, "--nproc-per-node", "2"]
        + ["--max-restarts", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while not ((out / "previous").is_dir() and read_metrics(out)) and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        assert read_metrics(out)[-1]["world_size"] == 2  # the new run's first epoch
        victim = lock_holder(out)
        os.kill(victim, signal.SIGKILL)  # rank 0, the holder of the lock
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert lock_holder(out) not in (None, victim)  # the restarted rank 0 took the lock over
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert len(list((out / "previous").iterdir())) == 1  # moved aside once, by the job's first attempt
    assert "resumed from" in (out / "log.txt").read_text()


# ------------------------------------------------------------------------------------------ OS failures


def test_an_out_dir_under_a_file_or_with_a_file_for_checkpoints_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_cli("train", f"out_dir={tmp_path / 'afile' / 'run'}", *QUICK)
    assert_user_error(proc, "cannot be made", "is a file, not a folder")
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    assert_user_error(run_cli("train", f"out_dir={out}", *QUICK), "checkpoints' is not a folder")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"]


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB tmpfs mounted for the test (root only): a disk that fills up, or is made read-only."""
    if not _can_mount():
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_is_one_line_naming_the_file_and_the_free_space(small_disk):
    out = small_disk / "run"
    proc = run_cli("train", f"out_dir={out}", *QUICK, "train.epochs=3")
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no space left on device writing" in errors[0] and str(out) in errors[0]
    assert f"free on {small_disk}" in errors[0] and "unexpected pos" not in errors[0]


def test_a_read_only_out_dir_is_refused_naming_it(small_disk):
    # root ignores permission bits, so the disk itself is made read-only
    out = small_disk / "run"
    out.mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    proc = run_cli("train", f"out_dir={out}", *QUICK)
    assert_user_error(proc, f"out_dir '{out}' is on a read-only file system")
    assert_user_error(run_cli("train", f"out_dir={out / 'new'}", *QUICK), "read-only file system")


def test_a_file_size_limit_is_one_line_naming_the_file_and_the_limit(tmp_path):
    out = tmp_path / "run"
    limit = 48 * 1024  # `ulimit -f 48`: config.yaml and log.txt fit, a checkpoint does not

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            f"out_dir={out}",
            *QUICK,
            "model.arch=cnn",
            "train.epochs=1",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        preexec_fn=small_files,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "file too large writing" in errors[0] and "epoch_0001.pt" in errors[0] and "ulimit -f" in errors[0]


def test_a_closed_stdout_does_not_stop_training(tmp_path):
    # `ddpkit train | head -1`: the reader goes away after one line; training goes on, log.txt has it all
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", f"out_dir={out}", *QUICK, "train.epochs=3"]
        + ["train.log_every=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    assert proc.stdout.readline().startswith(b"ddpkit: 1 process(es)")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err[-3000:]
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2, 3]
    assert "final val_acc1" in (out / "log.txt").read_text()
