"""Two "hosts" (network namespaces on one veth link, each with its own address and host name): static and
c10d rendezvous across them, a node that never arrives, and a 2 nodes x 2 processes training job."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import assert_user_error

from .helpers import PY, TRAIN, assert_trained, finish, ok, rank_lines

pytestmark = pytest.mark.system


def static(netns, port: int, nproc: int = 2) -> list[str]:
    """Launch flags of a static 2-node rendezvous at node 0's address."""
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        netns.addrs[0],
        "--master-port",
        str(port),
    ]


def test_two_nodes_static_rendezvous_four_ranks_over_the_veth_link(netns):
    node0 = netns.ddpkit(0, "info", *static(netns, 29411), "--node-rank", "0")
    node1 = netns.ddpkit(1, "info", *static(netns, 29411), "--node-rank", "1")
    out0, _ = (ok(r) for r in finish([node0, node1]))
    lines = rank_lines(out0)
    a, b = netns.addrs
    assert [(x["rank"], x["local_rank"], x["node_rank"], x["host"]) for x in lines] == [
        ("0", "0", "0", a),
        ("1", "1", "0", a),
        ("2", "0", "1", b),
        ("3", "1", "1", b),
    ], out0
    assert {x["world_size"] for x in lines} == {"4"}, out0
    assert {x["iface"] for x in lines} == {netns.ifname}, out0
    assert {x["master"] for x in lines} == {f"{a}:29411"}, out0


def test_two_nodes_c10d_rendezvous_node1_starts_first(netns):
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"{netns.addrs[0]}:29421",
        "--rdzv-id",
        "sys-c10d",
    ]
    node1 = netns.ddpkit(1, "info", *flags)
    time.sleep(3)  # node 1 waits for the rendezvous endpoint that node 0 has not opened yet
    assert node1.poll() is None, node1.communicate()
    node0 = netns.ddpkit(0, "info", *flags)
    out = "".join(ok(r) for r in finish([node1, node0]))
    lines = rank_lines(out)
    assert sorted(int(x["rank"]) for x in lines) == [0, 1, 2, 3], out
    by_host = {
        h: sorted((int(x["rank"]), int(x["local_rank"])) for x in lines if x["host"] == h)
        for h in netns.addrs
    }
    assert sorted(by_host.values()) == [[(0, 0), (1, 1)], [(2, 0), (3, 1)]], out
    assert {x["iface"] for x in lines} == {netns.ifname}, out


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_node_that_never_arrives_fails_clearly_after_the_rdzv_timeout(netns, rendezvous):
    port = {"static": 29431, "c10d": 29432}[rendezvous]
    if rendezvous == "static":
        flags = [*static(netns, port, nproc=1), "--node-rank", "0"]
    else:
        flags = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            f"{netns.addrs[0]}:{port}",
            "--rdzv-id",
            "gone",
        ]
    start = time.monotonic()
    (proc,) = finish([netns.ddpkit(0, "info", *flags, "--rdzv-timeout", "5")], timeout=120)
    elapsed = time.monotonic() - start
    assert_user_error(proc, "joined the rendezvous", f"{netns.addrs[0]}:{port}", "--rdzv-timeout 5")
    assert elapsed < 60, elapsed


def test_two_nodes_two_processes_each_train_one_four_rank_job(netns, tmp_path):
    out_dir = tmp_path / "run"  # the namespaces share the file system, like nodes with a shared home
    args = ["train", *TRAIN, f"out_dir={out_dir}", *static(netns, 29441)]
    procs = [netns.ddpkit(0, *args, "--node-rank", "0"), netns.ddpkit(1, *args, "--node-rank", "1")]
    for proc in finish(procs, timeout=300):
        ok(proc)
    assert_trained(out_dir, world_size=4)


def test_a_wrong_master_address_fails_clearly_on_the_joining_node(netns):
    wrong = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "10.77.0.9", "--master-port", "29461"]
    (proc,) = finish(
        [netns.ddpkit(1, "info", *wrong, "--node-rank", "1", "--rdzv-timeout", "5")], timeout=120
    )
    assert_user_error(proc, "could not reach the rendezvous at 10.77.0.9:29461")


def test_a_rendezvous_port_in_use_fails_clearly(netns):
    hold = f"import socket, time; s = socket.socket(); s.bind(('{netns.addrs[0]}', 29471)); s.listen(); print('ready', flush=True); time.sleep(120)"
    holder = subprocess.Popen(netns.argv(0, PY, "-c", hold), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        (proc,) = finish(
            [
                netns.ddpkit(
                    0, "info", *static(netns, 29471, nproc=1), "--node-rank", "0", "--rdzv-timeout", "5"
                )
            ]
        )
    finally:
        holder.kill()
        holder.communicate()
    assert_user_error(proc, "already in use", "--master-port")
