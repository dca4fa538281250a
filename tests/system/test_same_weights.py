"""Every launcher, same seed and world size 2: bit-identical final weights."""

from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import cli_env, run_cli

from .helpers import PY, TRAIN, assert_trained, final_weights, finish, ok

pytestmark = pytest.mark.system


def test_every_launcher_gives_the_same_final_weights(tmp_path, slurm, openmpi, netns):
    def train(name: str) -> list[str]:
        return ["train", *TRAIN, f"out_dir={tmp_path / name}"]

    ok(run_cli(*train("torchrun"), "--nproc-per-node", "2"))
    ok(run_cli(*train("spawn"), "--nproc-per-node", "2", "--launcher", "spawn"))
    ok(slurm.run("srun", "-n", "2", "--export=ALL", PY, "-m", "ddpkit", *train("srun")))
    env = cli_env()
    mpi = openmpi.argv(2, PY, "-m", "ddpkit", *train("mpirun"), env=env)
    ok(subprocess.run(mpi, capture_output=True, text=True, timeout=300, env=env))
    nodes = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        netns.addrs[0],
        "--master-port",
        "29451",
    ]
    for proc in finish(
        [netns.ddpkit(r, *train("netns"), *nodes, "--node-rank", str(r)) for r in (0, 1)], timeout=300
    ):
        ok(proc)

    reference = final_weights(tmp_path / "torchrun")
    differ = {}
    for name in ("spawn", "srun", "mpirun", "netns"):
        assert_trained(tmp_path / name, world_size=2)
        weights = final_weights(tmp_path / name)
        assert weights.keys() == reference.keys(), name
        bad = [k for k in reference if not torch.equal(weights[k], reference[k])]
        if bad:
            differ[name] = bad
    assert not differ, f"final weights differ from --nproc-per-node 2: {differ}"
