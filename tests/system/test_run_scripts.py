"""`ddpkit run` under the launchers that start one process per rank: a torchrun-style script and a ported script,
unchanged, under srun, mpirun and across two "hosts" (network namespaces), with torchrun's final weights."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, cli_env

from .helpers import PY, all_ok, finish, ok

pytestmark = pytest.mark.system

SCRIPTS = REPO / "tests" / "scripts"
# two tasks of the test cluster, each running `ddpkit run` on the rest of the command line
SRUN_TWO_TASKS = ["srun", "-n", "2", "--export=ALL", PY, "-m", "ddpkit", "run"]
TORCHRUN_STYLE = [str(SCRIPTS / "torchrun_ddp.py"), "--epochs", "2"]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), {k: (wa[k] - wb[k]).abs().max().item() for k in wa}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The torchrun-style script under torch's torchrun on 2 processes."""
    work = tmp_path_factory.mktemp("torchrun")
    argv = [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *TORCHRUN_STYLE,
        "--out",
        "w.pt",
    ]
    ok(subprocess.run(argv, capture_output=True, text=True, timeout=300, env=cli_env(), cwd=work))
    return work / "w.pt"


def test_srun_two_tasks_run_a_torchrun_style_script_unchanged(slurm, tmp_path, reference):
    out = ok(
        slurm.run(
            *SRUN_TWO_TASKS,
            *TORCHRUN_STYLE,
            "--out",
            "w.pt",
            cwd=tmp_path,
            timeout=300,
        )
    )
    assert "[GPU0] Epoch 0" in out and "[GPU1] Epoch 0" in out, out
    assert_same(tmp_path / "w.pt", reference)


def test_mpirun_two_ranks_run_a_torchrun_style_script_unchanged(openmpi, tmp_path, reference):
    env = cli_env()
    argv = openmpi.argv(2, PY, "-m", "ddpkit", "run", *TORCHRUN_STYLE, "--out", "w.pt", env=env)
    ok(subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path))
    assert_same(tmp_path / "w.pt", reference)


def test_two_hosts_run_a_torchrun_style_script_unchanged(netns, tmp_path, reference):
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        netns.addrs[0],
        "--master-port",
        "29491",
    ]
    # Each host works in its own folder, as on two machines: the script (like the tutorial it follows) has
    # local rank 0 of every node write snapshot.pt, which on one shared folder would race.
    homes = [tmp_path / "nodea", tmp_path / "nodeb"]
    for home in homes:
        home.mkdir()
    procs = [
        subprocess.Popen(
            netns.argv(
                node,
                PY,
                "-m",
                "ddpkit",
                "run",
                *flags,
                "--node-rank",
                str(node),
                *TORCHRUN_STYLE,
                "--out",
                "w.pt",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=netns.env(),
            cwd=cwd,
        )
        for node, cwd in enumerate(homes)
    ]
    all_ok(finish(procs, timeout=300))
    assert_same(homes[0] / "w.pt", reference)  # global rank 0 runs on node 0
    assert (homes[1] / "snapshot.pt").is_file()  # the script's per-node snapshot (local rank 0 of each node)


def test_the_ported_script_under_srun_and_mpirun_matches_ddpkit_run(slurm, openmpi, tmp_path):
    ported = [str(SCRIPTS / "ported.py"), "--epochs", "1", "--out"]
    env = cli_env()
    local = [PY, "-m", "ddpkit", "run", "--nproc-per-node", "2", *ported, "local.pt"]
    ok(subprocess.run(local, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path))
    out = ok(
        slurm.run(
            *SRUN_TWO_TASKS,
            *ported,
            "srun.pt",
            cwd=tmp_path,
            timeout=300,
        )
    )
    assert "on 333 samples" in out, out  # exact evaluation over the two Slurm tasks
    argv = openmpi.argv(2, PY, "-m", "ddpkit", "run", *ported, "mpi.pt", env=env)
    ok(subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path))
    assert_same(tmp_path / "srun.pt", tmp_path / "local.pt")
    assert_same(tmp_path / "mpi.pt", tmp_path / "local.pt")
