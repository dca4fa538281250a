"""The launcher's job folders (rank pids, stack dumps, error lines): a folder left by a launcher that was killed
is removed by the next launcher; a live launcher's is never touched. Budget: 2 s (one short child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from ddpkit.diagnostics.stacks import JOB_PREFIX, Watch, sweep_stale_jobs


def test_a_killed_launchers_job_folder_goes_and_a_live_ones_stays(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)  # exited and reaped: no process has this pid (barring reuse within the test)
    stale = tmp_path / f"{JOB_PREFIX}{dead_pid}-abc123"
    live = tmp_path / f"{JOB_PREFIX}{os.getpid()}-def456"
    other = tmp_path / "ddpkit-jobless-1-x"
    for d in (stale, live, other):
        d.mkdir()
        (d / "rank0.pid").write_text("1")
    assert sweep_stale_jobs(str(tmp_path)) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_each_watch_sweeps_and_removes_its_own_folder_at_the_end(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{JOB_PREFIX}999999999-zz"  # above any pid_max: never a running process
    stale.mkdir()
    with Watch() as watch:
        assert watch.job.parent == tmp_path and watch.job.is_dir() and not stale.exists()
    assert not watch.job.exists()
