"""Two "hosts" (network namespaces on one bridge, each with its own address, host name and /etc/hosts that maps
its own name to 127.0.1.1, as Debian does): static and c10d rendezvous across them with no *_SOCKET_IFNAME set,
the interface ddpkit picks, a node that never arrives, and training that ends bit-identical to one node."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from conftest import assert_user_error, run_cli

from .helpers import PY, TRAIN, assert_trained, c10d, final_weights, finish, ok, rank_lines

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


def both(
    netns, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """`ddpkit ARGS --node-rank R` on both nodes at once; their results."""
    procs = [netns.ddpkit(r, *args, "--node-rank", str(r), env=env) for r in (0, 1)]
    return finish(procs, timeout=timeout)


def test_two_nodes_static_rendezvous_picks_the_link_by_its_route(netns):
    out0, _ = (ok(r) for r in both(netns, "info", *static(netns, 29411)))
    lines = rank_lines(out0)
    (a, b), (host_a, host_b) = netns.addrs, netns.hosts
    assert [(x["rank"], x["local_rank"], x["node_rank"], x["host"]) for x in lines] == [
        ("0", "0", "0", host_a),
        ("1", "1", "0", host_a),
        ("2", "0", "1", host_b),
        ("3", "1", "1", host_b),
    ], out0
    assert {x["world_size"] for x in lines} == {"4"}, out0
    assert [(x["iface"], x["addr"], x["iface_from"]) for x in lines] == [
        (netns.ifname, a, "route"),
        (netns.ifname, a, "route"),
        (netns.ifname, b, "route"),
        (netns.ifname, b, "route"),
    ], out0
    assert {x["master"] for x in lines} == {f"{a}:29411"}, out0


def test_the_users_interface_wins(netns):
    env = {"GLOO_SOCKET_IFNAME": netns.ifname}
    out0, _ = (ok(r) for r in both(netns, "info", *static(netns, 29412, nproc=1), env=env))
    lines = rank_lines(out0)
    assert [(x["iface"], x["addr"], x["iface_from"]) for x in lines] == [
        (netns.ifname, netns.addrs[0], "user"),
        (netns.ifname, netns.addrs[1], "user"),
    ], out0


def test_an_interface_name_that_does_not_exist_is_one_line(netns):
    env = {"GLOO_SOCKET_IFNAME": "eth9"}
    (proc,) = finish([netns.ddpkit(1, "info", *static(netns, 29413, nproc=1), "--node-rank", "1", env=env)])
    assert_user_error(proc, "GLOO_SOCKET_IFNAME=eth9 names no interface", netns.ifname)


def test_two_nodes_c10d_rendezvous_node1_starts_first(netns):
    flags = c10d(netns.addrs[0], 29421, "sys-c10d", 2)
    node1 = netns.ddpkit(1, "info", *flags)
    time.sleep(3)  # node 1 waits for the rendezvous endpoint that node 0 has not opened yet
    assert node1.poll() is None, node1.communicate()
    node0 = netns.ddpkit(0, "info", *flags)
    out = "".join(ok(r) for r in finish([node1, node0]))
    lines = rank_lines(out)
    assert sorted(int(x["rank"]) for x in lines) == [0, 1, 2, 3], out
    by_host = {
        h: sorted((int(x["rank"]), int(x["local_rank"])) for x in lines if x["host"] == h)
        for h in netns.hosts
    }
    assert sorted(by_host.values()) == [[(0, 0), (1, 1)], [(2, 0), (3, 1)]], out
    assert {(x["iface"], x["iface_from"]) for x in lines} == {(netns.ifname, "route")}, out


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_a_node_that_never_arrives_fails_clearly_after_the_rdzv_timeout(netns, rendezvous):
    port = {"static": 29431, "c10d": 29432}[rendezvous]
    if rendezvous == "static":
        flags = [*static(netns, port, nproc=1), "--node-rank", "0"]
    else:
        flags = c10d(netns.addrs[0], port, "gone")
    start = time.monotonic()
    (proc,) = finish([netns.ddpkit(0, "info", *flags, "--rdzv-timeout", "5")], timeout=120)
    elapsed = time.monotonic() - start
    assert_user_error(proc, "joined the rendezvous", f"{netns.addrs[0]}:{port}", "--rdzv-timeout 5")
    assert elapsed < 60, elapsed


def test_two_nodes_without_socket_ifname_train_to_the_weights_of_one_node(netns, tmp_path):
    # The namespaces' host names resolve to 127.0.1.1 and nothing names an interface: without ddpkit's choice gloo
    # advertises the loopback address and the job fails ("Gloo connectFullMesh failed ... remote=[127.0.1.1]").
    train = ["train", *TRAIN]
    results = both(netns, *train, f"out_dir={tmp_path / 'two'}", *static(netns, 29441), timeout=300)
    for proc in results:
        ok(proc)
    ok(run_cli(*train, f"out_dir={tmp_path / 'one'}", "--nproc-per-node", "4"))
    assert_trained(tmp_path / "two", world_size=4)
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert one.keys() == two.keys()
    assert [k for k in one if not torch.equal(one[k], two[k])] == []


def _isolated(hosts_file, *command: str) -> list[str]:
    """`command` in a fresh network namespace with only loopback, under host name nodez and its own /etc/hosts."""
    setup = f'ip link set lo up && mount --bind {hosts_file} /etc/hosts && hostname nodez && exec "$@"'
    return ["unshare", "--net", "--mount", "--uts", "sh", "-c", setup, "sh", *command]


@pytest.mark.parametrize("where", ["master-unresolvable", "loopback-only"])
def test_a_host_name_on_loopback_with_no_usable_interface_is_one_line(netns, tmp_path, where):
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", "29481", "--rdzv-timeout", "5"]
    if where == "master-unresolvable":  # node 1 knows no address for the master's name
        proc = netns.ddpkit(1, "info", *launch, "--master-addr", "nodez", "--node-rank", "1")
    else:  # a host with nothing but loopback, told that it is the master of a 2-node job
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n127.0.1.1 nodez\n")
        argv = _isolated(
            hosts, PY, "-m", "ddpkit", "info", *launch, "--master-addr", "nodez", "--node-rank", "0"
        )
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=netns.env()
        )
    start = time.monotonic()
    (result,) = finish([proc], timeout=120)
    line = assert_user_error(
        result, "resolves to the loopback address 127.0.1.1", "GLOO_SOCKET_IFNAME", "/etc/hosts"
    )
    assert "nodez" in line and time.monotonic() - start < 30, line


def test_a_wrong_master_address_fails_clearly_on_the_joining_node(netns):
    wrong = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", netns.spare, "--master-port", "29461"]
    (proc,) = finish(
        [netns.ddpkit(1, "info", *wrong, "--node-rank", "1", "--rdzv-timeout", "5")], timeout=120
    )
    # within the rendezvous timeout, not the 30 s window of the master probe
    assert_user_error(proc, f"cannot reach the master at {netns.spare}:29461 after 5 s")


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
