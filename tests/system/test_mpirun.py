"""Open MPI's mpirun starts the ranks; ddpkit reads OMPI_COMM_WORLD_* and gloo does the communication."""

from __future__ import annotations

import subprocess

import pytest

from conftest import cli_env

from .helpers import PY, TRAIN, assert_trained, ok, rank_lines

pytestmark = pytest.mark.system


def mpirun(openmpi, np: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`mpirun -np NP python -m ddpkit ARGS` with the test environment passed to every rank."""
    env = cli_env()
    argv = openmpi.argv(np, PY, "-m", "ddpkit", *args, env=env)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def test_mpirun_info_two_ranks_from_ompi_variables(openmpi):
    out = ok(mpirun(openmpi, 2, "info"))
    lines = rank_lines(out)
    assert [(x["rank"], x["local_rank"], x["world_size"], x["launcher"]) for x in lines] == [
        ("0", "0", "2", "openmpi"),
        ("1", "1", "2", "openmpi"),
    ], out
    assert {x["backend"] for x in lines} == {"gloo"}, out


def test_mpirun_train_two_ranks_trains_one_job(openmpi, tmp_path):
    out_dir = tmp_path / "run"
    ok(mpirun(openmpi, 2, "train", *TRAIN, f"out_dir={out_dir}"))
    assert_trained(out_dir, world_size=2)
