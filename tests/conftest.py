"""Shared test helpers: run the real CLI in a subprocess, and run a function on N real gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The suite runs 3 and 4 processes on a 2-core machine on purpose (odd world sizes, prime-sized shards);
# test_more_processes_than_cores_is_refused unsets it.
os.environ.setdefault("DDPKIT_OVERSUBSCRIBE", "1")


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ddpkit subprocess: no launcher variables leaking in from the test runner."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
        )
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd=None):
    """`python -m ddpkit ARGS` -> CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=cwd,
    )


def plain_torchrun(*args: str, cwd: Path, fresh: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone ARGS` (torch's own launcher, a reference for ddpkit's) in `cwd`; must succeed.

    Under plain torchrun a rank sometimes aborts at interpreter exit after a run that succeeded (gloo's threads
    during finalization: "terminate called without an active exception", SIGABRT), which fails the job. That
    is torch's behaviour, not the code under test (`ddpkit run` avoids it: see distributed/usermain.py), so
    such a run is made again from scratch, with the files in `fresh` removed first; any other failure fails.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    for _ in range(3):
        for name in fresh:
            (Path(cwd) / name).unlink(missing_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(), cwd=cwd)
        if proc.returncode == 0 or "Signal 6 (SIGABRT)" not in proc.stderr:
            break
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def assert_user_error(proc, *fragments: str) -> str:
    """Exit 2, exactly one `ddpkit: error:` line on stderr, no traceback; returns the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for frag in fragments:
        assert frag in errors[0], (frag, errors[0])
    return errors[0]


def _group_entry(rank: int, world_size: int, init_file: str, fn, args, results) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn, world_size: int, *args, timeout: float = 120):
    """Run fn(rank, world_size, *args) on `world_size` real processes joined in a gloo group; results by rank.

    fn must be importable (defined at module level); its return value must pickle.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(target=_group_entry, args=(r, world_size, init_file, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out = {}
        try:
            for _ in range(world_size):
                rank, status, value = results.get(timeout=timeout)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world_size)]


@pytest.fixture
def tmp_run(tmp_path):
    """A fresh out_dir path (not created)."""
    return tmp_path / "run"
