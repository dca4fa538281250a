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
import time
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
def test_torchrun_spellings_local_rank_file_and_rank_prefix(tmp_path):
    """`--nproc_per_node=2 --standalone`, as torchrun is spelled; the script's own --local_rank gets 0 and 1;
    `__file__` is absolute (the chdir + open works); the failing rank's traceback carries `[rank1]:`."""
    script = _write(tmp_path, "old_launch.py", LOCAL_RANK_SCRIPT)
    (tmp_path / "beside.txt").write_text("found")
    proc = run_cli(
        "run", "--nproc_per_node=2", "--standalone", "--max_restarts", "0", "old_launch.py", "--tag", "x",
        cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    seen = sorted(re.findall(r"local_rank=\d tag=x beside=found file=\S+?\.py", proc.stdout))
    assert seen == [f"local_rank={r} tag=x beside=found file={script}" for r in (0, 1)], (
        proc.stdout + proc.stderr[-3000:]
    )
    assert "[rank1]: Traceback (most recent call last):" in proc.stderr, proc.stderr[-3000:]
    assert "[rank1]: ValueError: boom from rank 1" in proc.stderr
    assert re.search(r"rank 1 \(exit code 1\)[^\n]* failed", proc.stderr), proc.stderr[
        -2000:
    ]  # rank 0 may be ended first


def test_exit_3_passes_through_and_no_group_warning(tmp_path):
    """A script's own exit 3 is a failure named as such (never "preempted"), and a 2-process run that never
    made a process group gets one warning line."""
    _write(tmp_path, "exit3.py", EXIT3_SCRIPT)
    proc = run_cli("run", "--nproc-per-node", "2", "exit3.py", cwd=tmp_path, timeout=400)
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 (exit code 3)" in proc.stderr, proc.stderr
    assert "preempt" not in proc.stderr.lower(), proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "never created a process group" in ln]
    assert len(warnings) == 1, proc.stderr
    assert "WORLD_SIZE=2" in warnings[0] and "init_process_group" in warnings[0]


UNSHUFFLED_TRAIN_SCRIPT = """
import torch, ddpkit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(9, 4), torch.randint(0, 2, (9,))), batch_size=2)
model, opt, loader = ddpkit.prepare(model, opt, loader)
for x, y in loader:
    nn.functional.cross_entropy(model(x), y).backward()
"""


@pytest.mark.slow
def test_a_refusal_inside_a_script_is_one_line_for_the_job(tmp_path):
    """prepare()'s refusal of an unshuffled training loader, raised on every rank of a script under `ddpkit
    run`: one `ddpkit: error:` line (no traceback per rank), exit 2."""
    _write(tmp_path, "unshuffled.py", UNSHUFFLED_TRAIN_SCRIPT)
    proc = run_cli("run", "--nproc-per-node", "2", "unshuffled.py", cwd=tmp_path, timeout=400)
    assert_user_error(proc, "a loader prepared for evaluation (guessed from shuffle=False)", "roles=")


@pytest.mark.slow
def test_spawn_runs_guardless_dataloader_script_one_traceback_no_leftovers(tmp_path):
    """`--launcher spawn` with a guard-less script whose DataLoader has 2 workers: it runs (the launcher's start
    method does not leak into the DataLoader), the failing rank's full traceback is printed once, and no process
    of the run (ranks, DataLoader workers) outlives it."""
    _write(tmp_path, "guardless.py", GUARDLESS_SCRIPT)
    proc = run_cli(
        "run", "--nproc-per-node", "2", "--launcher", "spawn", "guardless.py", str(tmp_path),
        cwd=tmp_path, timeout=400,
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
    from ddpkit.distributed.torchrun_compat import resolve_nproc
    from ddpkit.launcher.spec import LAUNCH_FLAGS, STARTER_FLAGS, worker_argv

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

    from ddpkit.distributed.runtime import check_cpu_processes
    from ddpkit.launcher.spec import add_launch_flags, spec_from_args

    monkeypatch.setenv("DDPKIT_OVERSUBSCRIBE", "0")
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    cores = os.cpu_count() or 1
    spec = spec_from_args(parser.parse_args(["--nproc_per_node", str(cores + 1), "--oversubscribe"]), {})
    assert spec.nproc_per_node == cores + 1
    check_cpu_processes(spec.nproc_per_node)  # no UserError


# ---------------------------------------------------------------------------------------------- launch()


def _stuck_rank_one(marker: str):
    import ddpkit

    if ddpkit.get_rank() == 1:
        time.sleep(600)  # stuck outside any collective
    Path(marker).write_text(str(time.time()))
    return "rank 0 done"


def _rank_one_stuck_while_rank_zero_waits():
    import ddpkit

    if ddpkit.get_rank() == 1:
        time.sleep(600)
    ddpkit.barrier()  # rank 0 waits here until the group's timeout


@pytest.mark.slow
def test_launch_names_a_stuck_rank_within_its_timeout(tmp_path):
    """Rank 1 stuck outside any collective: launch() returns within timeout_s + 10 s of rank 0's end, naming
    rank 1; with rank 0 waiting in a barrier for it, rank 1 (not the waiting rank 0) is named."""
    import ddpkit
    from ddpkit.errors import WorkerFailure

    marker = tmp_path / "rank0"
    with pytest.raises(
        WorkerFailure, match=r"worker rank 1 hung: still running 5 s \(timeout_s\) after rank 0"
    ):
        ddpkit.launch(_stuck_rank_one, str(marker), nprocs=2, timeout_s=5)
    assert time.time() - float(marker.read_text()) < 5 + 10
    with pytest.raises(WorkerFailure, match=r"worker rank 1 hung: rank 0 timed out waiting for it"):
        ddpkit.launch(_rank_one_stuck_while_rank_zero_waits, nprocs=2, timeout_s=5)


def test_launch_of_a_lambda_or_closure_is_one_line_with_the_fix():
    import ddpkit
    from ddpkit.errors import UserError

    with pytest.raises(UserError, match="a lambda, which spawned processes cannot import") as e:
        ddpkit.launch(lambda: 1, nprocs=2)
    assert "top level of a module" in e.value.hint

    def inner():
        return 1

    with pytest.raises(UserError, match="defined in a function"):
        ddpkit.launch(inner, nprocs=2)


# ---------------------------------------------------------------------------------------------- prepare()


def _mnist_patterns():
    """The MNIST example's two settings, prepare() twice, a DistributedSampler loader, a shape mismatch."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import ddpkit
    from ddpkit.errors import UserError

    out = {}
    rank = ddpkit.get_rank()
    try:  # the first reduction checks every rank's shape
        ddpkit.all_reduce_sum([1, 2] if rank == 0 else [1, 2, 3])
    except UserError as e:
        out["mismatch"] = str(e)

    def model():
        torch.manual_seed(0)
        return nn.Linear(4, 2)

    def data(n):
        return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))

    def count(net, loader, train):
        net.train(train)
        try:
            return ddpkit.all_reduce_sum(sum(len(y) for _, y in loader))
        except UserError as e:
            return str(e)

    # GPU setting: the test loader is shuffled (1001 samples, batch 1000)
    net, test = ddpkit.prepare(model(), DataLoader(data(1001), batch_size=1000, shuffle=True))
    out["shuffled_test"] = count(net, test, train=False)
    with torch.no_grad():  # a test loop that forgot model.eval(): the pass under no_grad evaluates
        out["shuffled_test_no_grad_train_mode"] = count(net, test, train=True)
    net, test = ddpkit.prepare(model(), DataLoader(data(1001), batch_size=1000, shuffle=True), roles=["eval"])
    out["shuffled_test_said_eval"] = count(net, test, train=False)
    # CPU setting: the training loader is unshuffled (129 samples, batch 64)
    net, train = ddpkit.prepare(model(), DataLoader(data(129), batch_size=64))
    out["unshuffled_train"] = count(net, train, train=True)
    net, opt, train = ddpkit.prepare(
        model(),
        torch.optim.SGD(model().parameters(), lr=0.1),
        DataLoader(data(129), batch_size=64),
        roles=["train"],
    )
    steps = 0
    for x, y in train:  # DDP all-reduces every step: the shards must be even
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        steps += 1
    out["unshuffled_train_said_train_steps"] = ddpkit.all_gather_object(steps)
    # prepare twice
    again, train_again = ddpkit.prepare(net, train)
    out["twice"] = (again is net, train_again is train, sorted(again.state_dict())[0])
    # a loader that already has a DistributedSampler
    ds = data(10)
    own = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=False))
    out["distributed_sampler_kept"] = ddpkit.prepare(own) is own
    return out


@pytest.fixture(scope="module")
def mnist_patterns():
    import ddpkit

    return ddpkit.launch(_mnist_patterns, nprocs=2, timeout_s=60)


def test_prepare_refuses_a_guessed_role_used_the_other_way_and_counts_once_when_told(mnist_patterns):
    for r in mnist_patterns:
        assert "guessed to be for training" in r["shuffled_test"] and "roles=" in r["shuffled_test"]
        assert r["shuffled_test_said_eval"] == 1001  # every test sample once
        assert r["shuffled_test_no_grad_train_mode"] == 1001  # under torch.no_grad() too, in train mode
        assert "prepared for evaluation" in r["unshuffled_train"] and "roles=" in r["unshuffled_train"]
        assert r["unshuffled_train_said_train_steps"] == [2, 2]  # even shards: 65 samples each, 2 batches


def test_prepare_twice_a_distributed_sampler_and_a_shape_mismatch(mnist_patterns):
    for r in mnist_patterns:
        assert r["twice"] == (True, True, "module.bias")  # not module.module.*
        assert r["distributed_sampler_kept"]
        assert "rank 1 passed shape [3]" in r["mismatch"], r["mismatch"]


def _train_digits(ported: bool):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ddpkit

    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(50, 4), torch.randint(0, 3, (50,)))
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = DataLoader(ds, batch_size=8, shuffle=True), DataLoader(ds, batch_size=16)
    if ported:
        model, opt, train, val = ddpkit.prepare(model, opt, train, val)
    for _ in range(2):
        model.train()
        for x, y in train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        model.eval()
        for x, _ in val:
            model(x)
    return {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}


def test_one_process_port_reproduces_the_unported_weights_exactly():
    """Dropout, a shuffled training loader and an evaluation loader: prepare() in one process draws from
    torch's random stream exactly as the unported script's loaders do."""
    plain, ported = _train_digits(False), _train_digits(True)
    assert all(torch.equal(plain[k], ported[k]) for k in plain)


def test_local_rank_is_found_in_the_source_without_importing_it(tmp_path, monkeypatch):
    """`-m pkg.train` is looked up in the folders (its package is never imported in the launcher); a script
    that only mentions --local_rank in a comment does not declare it."""
    from ddpkit.distributed.local_rank import declared_flag

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('imported in the launcher')\n")
    (pkg / "train.py").write_text(
        'import argparse\nargparse.ArgumentParser().add_argument(\n  "--local-rank")\n'
    )
    (tmp_path / "plain.py").write_text("# run me with --local_rank? no: LOCAL_RANK is read\n")
    monkeypatch.chdir(tmp_path)
    assert declared_flag(["-m", "pkg.train"]) == "--local-rank"
    assert declared_flag(["plain.py"]) is None and declared_flag(["-m", "no.such"]) is None
