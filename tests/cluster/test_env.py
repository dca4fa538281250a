"""Launcher detection: each launcher's variable set -> one DistEnv, and every bad set -> a UserError."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest

from ddpkit.cluster.env import DistEnv, detect_env, manual_env
from ddpkit.cluster.slurm_env import expand_nodelist, parse_nodelist, slurm_port
from ddpkit.errors import UserError


def torchrun_vars(rank, local_rank, world, local_world, addr="10.0.0.1", port="29500"):
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }


def test_no_launcher_is_a_single_process():
    assert detect_env({}) == DistEnv()
    assert detect_env({}).world_size == 1 and detect_env({}).launcher == "none"


def test_torchrun_two_nodes_two_gpus_table():
    # The tutorials' table: 2 nodes x 2 GPUs -> local ranks 0 1 0 1, ranks 0 1 2 3.
    envs = [detect_env(torchrun_vars(r, r % 2, 4, 2)) for r in range(4)]
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert [e.local_rank for e in envs] == [0, 1, 0, 1]
    assert [e.node_rank for e in envs] == [0, 0, 1, 1]
    assert {e.world_size for e in envs} == {4} and {e.num_nodes for e in envs} == {2}
    assert {(e.master_addr, e.master_port, e.launcher) for e in envs} == {("10.0.0.1", 29500, "torchrun")}


def test_torchrun_group_rank_wins_for_node_rank():
    env = detect_env({**torchrun_vars(3, 1, 4, 2), "GROUP_RANK": "1"})
    assert env.node_rank == 1


def slurm_vars(procid, ntasks, localid, nodeid, nodelist="node[01-02]", per_node="2(x2)", job="4242"):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_JOB_ID": job,
    }


def test_slurm_two_nodes_two_tasks_each():
    envs = [detect_env(slurm_vars(r, 4, r % 2, r // 2)) for r in range(4)]
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert [e.local_rank for e in envs] == [0, 1, 0, 1]
    assert [e.node_rank for e in envs] == [0, 0, 1, 1]
    assert {e.local_world_size for e in envs} == {2}
    assert {e.master_addr for e in envs} == {"node01"}
    assert {e.launcher for e in envs} == {"slurm"} and {e.num_nodes for e in envs} == {2}
    assert len({e.master_port for e in envs}) == 1


def test_slurm_port_depends_on_job_and_master_port_wins():
    a = detect_env(slurm_vars(0, 1, 0, 0, job="100"))
    b = detect_env(slurm_vars(0, 1, 0, 0, job="101"))
    assert a.master_port != b.master_port
    assert 1024 < a.master_port < 65536
    assert detect_env({**slurm_vars(0, 1, 0, 0), "MASTER_PORT": "12345"}).master_port == 12345
    # the port of a job is the same on every node: a number from the id, a CRC of it otherwise (not Python's
    # hash(), which differs between processes), in 15000..34999
    assert slurm_port("7") == slurm_port("20007") == 15007 and slurm_port("19999") == 34999
    elsewhere = subprocess.run(
        [sys.executable, "-c", "from ddpkit.cluster.slurm_env import slurm_port; print(slurm_port('job-a'))"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "123"},
    )  # fmt: skip
    assert int(elsewhere.stdout) == slurm_port("job-a") == 15000 + zlib.crc32(b"job-a") % 20000


def test_slurm_step_task_count_wins_over_job_task_count():
    env = detect_env(
        {
            **slurm_vars(1, 8, 1, 0, per_node="8"),
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2",
        }
    )
    assert env.world_size == 2 and env.local_world_size == 2


def test_torchrun_inside_slurm_uses_torchrun_ranks():
    env = detect_env({**slurm_vars(0, 1, 0, 0), **torchrun_vars(3, 1, 4, 2)})
    assert env.launcher == "torchrun" and env.rank == 3


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
        ("a1", ["a1"]),
        ("n[1,3-4]", ["n1", "n3", "n4"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu[008-010],cpu1,cpu2", ["gpu008", "gpu009", "gpu010", "cpu1", "cpu2"]),
    ],
)
def test_fallback_nodelist_parser(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts
    assert expand_nodelist(nodelist, use_scontrol=False) == hosts


def test_malformed_nodelist():
    with pytest.raises(UserError, match="malformed"):
        parse_nodelist("node[01-03")
    with pytest.raises(UserError, match="malformed"):
        parse_nodelist("node[05-03]")


def test_open_mpi_single_node():
    env = detect_env(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.launcher) == (1, 1, 2, "openmpi")
    assert env.master_addr == "127.0.0.1"


def test_open_mpi_multi_node_needs_master_addr():
    base = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(UserError, match="MASTER_ADDR"):
        detect_env(base)
    env = detect_env({**base, "MASTER_ADDR": "host0"})
    assert (env.rank, env.local_rank, env.node_rank, env.master_addr) == (2, 0, 1, "host0")


def test_pmi():
    env = detect_env({"PMI_RANK": "0", "PMI_SIZE": "3"})
    assert (env.rank, env.world_size, env.launcher) == (0, 3, "pmi")


@pytest.mark.parametrize(
    "variables, fragment",
    [
        ({"RANK": "0"}, "WORLD_SIZE missing"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside world size"),
        ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside world size"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, "MASTER_PORT missing"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"}, "out of range"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "at least 1"),
        (
            {
                "RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "3",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1",
            },
            "local rank",
        ),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n1"}, "outside world size"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE missing"),
        ({"PMI_SIZE": "2"}, "PMI_RANK missing"),
    ],
)
def test_bad_variable_sets(variables, fragment):
    with pytest.raises(UserError, match=fragment):
        detect_env(variables)


def test_manual_tcp_and_file(tmp_path):
    env = manual_env("tcp://127.0.0.1:22225", 2, 3)
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.launcher) == (
        2,
        3,
        "127.0.0.1",
        22225,
        "manual",
    )
    f = manual_env(f"file://{tmp_path}/shared", 0, 2)
    assert f.init_method == f"file://{tmp_path}/shared"


@pytest.mark.parametrize(
    "url, rank, world, fragment",
    [
        ("tcp://127.0.0.1:22225", None, 3, "needs --rank"),
        ("tcp://127.0.0.1:22225", 3, 3, "outside world size"),
        ("tcp://127.0.0.1", 0, 3, "bad --init-method"),
        ("tcp://127.0.0.1:0", 0, 3, "out of range"),
        ("udp://x:1", 0, 2, "unsupported"),
        ("file://relative/path", 0, 2, "three slashes"),
        ("file:///no/such/dir/f", 0, 2, "does not exist"),
    ],
)
def test_manual_bad_inputs(url, rank, world, fragment):
    with pytest.raises(UserError, match=fragment):
        manual_env(url, rank, world)


def test_lsf_jsrun_is_a_table_entry():
    env = {"JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_LOCAL_RANK": "1",
           "JSM_NAMESPACE_LOCAL_SIZE": "2", "MASTER_ADDR": "h1", "LSB_JOBID": "77"}  # fmt: skip
    e = detect_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.node_rank, e.num_nodes, e.launcher) == (
        3,
        4,
        1,
        1,
        2,
        "lsf",
    )
    assert e.master_addr == "h1"


def test_pbs_pbsdsh_reads_the_node_file(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn2\n")
    e = detect_env({"PBS_VNODENUM": "2", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "9.server"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.num_nodes) == (
        2,
        4,
        0,
        2,
        1,
        2,
    )
    assert (e.master_addr, e.launcher) == ("n1", "pbs")


def test_slurm_facts_are_one_place_for_the_launcher_and_the_detector():
    from ddpkit.cluster.slurm_env import slurm_job_step, slurm_nodelist

    env = {
        "SLURM_NODELIST": "a[1-2]",
        "SLURM_JOB_NODELIST": "b[1-2]",
        "SLURM_JOB_ID": "5",
        "SLURM_STEPID": "3",
    }
    assert (slurm_nodelist(env), slurm_job_step(env)) == ("a[1-2]", "5.3")
    assert slurm_nodelist({"SLURM_STEP_NODELIST": "c1", **env}) == "c1"
