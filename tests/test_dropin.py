"""Drop-in: torchrun's spellings, `--local_rank` scripts, `--launcher spawn` equal to the default launcher, what a
script sees (`__file__`, its exit codes, `[rankN]:` prefixes), the no-process-group warning, `ddpkit.launch`
naming the culprit rank, and `prepare()` that never guesses a loader's role silently.

Budget: ~120 s on a quiet 2-core machine (each `ddpkit run` below is one 2-process job covering several
assertions; the prepare() cases share one 2-process group).
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

from conftest import assert_user_error, run_cli

# A script written for `python -m torch.distributed.launch`: reads --local_rank from argv, changes directory and
# then opens a file beside itself through __file__, makes a group, and rank 1 fails with a traceback.
LOCAL_RANK_SCRIPT = """
import argparse, os
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--tag")
args = parser.parse_args()
os.chdir("/")
with open(os.path.join(os.path.dirname(__file__), "beside.txt")) as f:
    beside = f.read().strip()
dist.init_process_group("gloo")
print(f"local_rank={args.local_rank} tag={args.tag} beside={beside} file={__file__}", flush=True)
dist.barrier()
if dist.get_rank() == 1:
    raise ValueError("boom from rank 1")
dist.destroy_process_group()
"""

# Rank 1 exits 3 on its own; rank 0 ends normally. Neither makes a process group.
EXIT3_SCRIPT = """
import os, pathlib, sys, time
if os.environ["RANK"] == "1":
    while not pathlib.Path("rank0-done").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0 has said what it has to say
    sys.exit(3)
pathlib.Path("rank0-done").write_text("")
"""

# No `if __name__ == "__main__":` guard, DataLoader workers, pids written down; rank 1 fails, rank 0 waits.
GUARDLESS_SCRIPT = """
import os, sys, pathlib
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
out = pathlib.Path(sys.argv[1])
loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=2, num_workers=2, persistent_workers=True)
n = sum(len(b[0]) for b in loader)
it = iter(loader)
next(it)  # the workers stay alive
kids = pathlib.Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
(out / f"pids{rank}").write_text(" ".join([str(os.getpid()), *kids]))
(out / f"n{rank}").write_text(str(n))
dist.barrier()
if rank == 1:
    raise ValueError("boom in a guard-less script")
dist.barrier()  # never completes: rank 1 is gone
"""


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_torchrun_spellings_local_rank_file_and_rank_prefix(tmp_path):
    """`--nproc_per_node=2 --standalone`, as torchrun is spelled; the script's own --local_rank gets 0 and 1;
    `__file__` is absolute (the chdir + open works); the failing rank's traceback carries `[rank1]:`."""
    script = _write(tmp_path, "old_launch.py", LOCAL_RANK_SCRIPT)
    (tmp_path / "beside.txt").write_text("found")
    proc = run_cli(
        "run", "--nproc_per_node=2", "--standalone", "--max_restarts", "0", "old_launch.py", "--tag", "x",
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    seen = sorted(re.findall(r"local_rank=\d tag=x beside=found file=\S+?\.py", proc.stdout))
    assert seen == [f"local_rank={r} tag=x beside=found file={script}" for r in (0, 1)], (
        proc.stdout + proc.stderr[-3000:]
    )
    assert "[rank1]: Traceback (most recent call last):" in proc.stderr, proc.stderr[-3000:]
    assert "[rank1]: ValueError: boom from rank 1" in proc.stderr
    assert "worker rank 1 (exit code 1) failed" in proc.stderr


def test_exit_3_passes_through_and_no_group_warning(tmp_path):
    """A script's own exit 3 is a failure named as such (never "preempted"), and a 2-process run that never
    made a process group gets one warning line."""
    _write(tmp_path, "exit3.py", EXIT3_SCRIPT)
    proc = run_cli("run", "--nproc-per-node", "2", "exit3.py", cwd=tmp_path, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 (exit code 3)" in proc.stderr, proc.stderr
    assert "preempt" not in proc.stderr.lower(), proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "never created a process group" in ln]
    assert len(warnings) == 1, proc.stderr
    assert "WORLD_SIZE=2" in warnings[0] and "init_process_group" in warnings[0]


def test_spawn_runs_guardless_dataloader_script_one_traceback_no_leftovers(tmp_path):
    """`--launcher spawn` with a guard-less script whose DataLoader has 2 workers: it runs (the launcher's start
    method does not leak into the DataLoader), the failing rank's full traceback is printed once, and no process
    of the run (ranks, DataLoader workers) outlives it."""
    _write(tmp_path, "guardless.py", GUARDLESS_SCRIPT)
    proc = run_cli(
        "run", "--nproc-per-node", "2", "--launcher", "spawn", "guardless.py", str(tmp_path),
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert [(tmp_path / f"n{r}").read_text() for r in (0, 1)] == ["16", "16"], proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr
    assert "[rank1]: ValueError: boom in a guard-less script" in proc.stderr
    assert 'guardless.py", line' in proc.stderr  # the script's own frames
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids{r}").read_text().split()]
    assert len(pids) >= 6, pids
    left = [p for p in pids if _alive(p)]
    assert not left, left


def test_nproc_per_node_words_and_oversubscribe(tmp_path):
    """`--nproc-per-node cpu|auto` count as torchrun counts them; `--oversubscribe` allows more processes than
    cores (refused without it); a bad word is one error line."""
    from ddpkit.distributed.launch import LAUNCH_FLAGS, STARTER_FLAGS, worker_argv
    from ddpkit.distributed.torchrun_compat import resolve_nproc

    cores = os.cpu_count() or 1
    assert resolve_nproc("cpu") == cores and resolve_nproc("auto") == cores  # no GPU here
    assert {"--nproc_per_node", "--master_addr", "--rdzv_endpoint", "--standalone"} <= STARTER_FLAGS
    assert "--local_rank" in LAUNCH_FLAGS
    argv = ["train", "--nproc_per_node", "2", "--standalone", "--oversubscribe", "a.b=1"]
    assert worker_argv(argv) == ["train", "a.b=1"]
    assert_user_error(run_cli("run", "--nproc-per-node", "many", "x.py"), "--nproc-per-node", "auto")
    _write(tmp_path, "x.py", "")
    refused = run_cli(
        "run", "--nproc-per-node", str(cores + 1), "x.py", env={"DDPKIT_OVERSUBSCRIBE": "0"}, cwd=tmp_path
    )
    assert_user_error(refused, "--oversubscribe")


def test_oversubscribe_flag_allows_more_processes_than_cores(monkeypatch):
    import argparse

    from ddpkit.distributed.launch import add_launch_flags, spec_from_args
    from ddpkit.distributed.runtime import check_cpu_processes

    monkeypatch.setenv("DDPKIT_OVERSUBSCRIBE", "0")
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    cores = os.cpu_count() or 1
    spec = spec_from_args(parser.parse_args(["--nproc_per_node", str(cores + 1), "--oversubscribe"]), {})
    assert spec.nproc_per_node == cores + 1
    check_cpu_processes(spec.nproc_per_node)  # no UserError
