"""Heartbeats (ddpkit.train.health): who fell behind, named after a failed collective."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from conftest import cli_env, dist_context, run_group
from ddpkit.errors import WorkerFailure
from ddpkit.train.health import Heartbeat, explain_comm_failures, stop_heartbeat


def test_a_single_process_beats_nowhere_and_its_errors_pass_through():
    ctx = dist_context(0, 1)
    with Heartbeat(0, 1) as heartbeat:
        assert heartbeat.read() == {} and heartbeat.diagnose() == ""
        with pytest.raises(RuntimeError, match="gloo"):
            with explain_comm_failures(ctx, heartbeat, lambda: 3):
                raise RuntimeError("[gloo] connection closed by peer")  # nobody else to blame


def _stale_peer(rank: int, world_size: int) -> dict:
    out: dict = {}
    heartbeat = Heartbeat(rank, world_size, interval_s=0.2)
    heartbeat.step = 7 if rank == 1 else 9
    time.sleep(0.6)
    out["read"] = sorted(heartbeat.read())
    if rank == 1:
        heartbeat.close()  # rank 1 stops beating (as a SIGSTOPped or dead rank would)
    dist.barrier()
    if rank == 0:
        time.sleep(2.0)  # past 3 intervals + 1 s: rank 1's last beat is stale
        try:
            with explain_comm_failures(dist_context(rank, world_size), heartbeat, lambda: 12):
                raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        except WorkerFailure as e:
            out["failure"] = str(e)
        try:
            with explain_comm_failures(dist_context(rank, world_size), heartbeat, lambda: 12):
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")  # a bug here, not a peer
        except RuntimeError as e:
            out["passed_through"] = type(e) is RuntimeError
    dist.barrier()
    other = Heartbeat(rank, world_size, interval_s=0.2)
    stop_heartbeat()  # what the runtime calls before the process group goes away
    out["stopped"] = not other._thread.is_alive() and not heartbeat._thread.is_alive()
    dist.barrier()
    return out


@pytest.mark.slow
def test_the_rank_that_stopped_beating_is_named_with_its_last_step():
    rank0, rank1 = run_group(_stale_peer, 2)
    assert rank0["read"] == rank1["read"] == [0, 1]  # every rank sees every rank's beat
    assert rank0["failure"].startswith("rank 0 gave up on a collective at step 12 (")
    host = socket.gethostname()  # the host names where the rank ran: the one a user must look at
    assert f"stopped responding: rank 1 on {host} (last heartbeat at step 7, " in rank0["failure"]
    assert rank0["passed_through"]
    assert rank0["stopped"] and rank1["stopped"]


BEATING_EXIT_SCRIPT = r"""
import sys, time
import torch.distributed as dist
import ddpkit
from ddpkit.train.health import Heartbeat

ctx = ddpkit.init_distributed("gloo", "cpu", 30)
Heartbeat(ctx.rank, ctx.world_size, interval_s=0.0)  # never closed by the caller, always inside the store
time.sleep(0.3)
dist.barrier()
sys.stdout.write(f"rank {ctx.rank} done\n")  # one write: the ranks share a pipe
sys.stdout.flush()
sys.exit(0)
"""


def test_a_heartbeat_left_running_never_aborts_the_exit(tmp_path):
    # A daemon thread still inside a store call when the interpreter exits is killed mid-C++-call and the
    # process dies of SIGABRT ("terminate called without an active exception") after a successful run.
    script = tmp_path / "beating.py"
    script.write_text(BEATING_EXIT_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert sorted(proc.stdout.split()) == sorted("rank 0 done rank 1 done".split())


def test_the_runtime_stops_every_heartbeat_before_the_group_goes():
    from ddpkit.distributed import runtime

    assert stop_heartbeat in runtime.BEFORE_SHUTDOWN  # registered by the module that starts heartbeats
