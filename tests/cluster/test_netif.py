"""The network interface ddpkit picks for a job that spans nodes, checked against this host's real interfaces and
routes (as `ip` reports them). Two-host cases (namespaces, a host name on 127.0.1.1) run in
tests/system/test_multinode.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from ddpkit.cluster import netif
from ddpkit.errors import UserError

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="ddpkit picks interfaces on Linux"
)


def ip(*args: str) -> str:
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is needed to check against")
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 address, from `ip -o -4 addr`."""
    out = []
    for line in ip("-o", "-4", "addr").splitlines():
        fields = line.split()
        out.append((fields[1], fields[3].split("/")[0]))
    return out


def test_the_addresses_are_those_ip_reports():
    ours = {(name, addr) for name, addr, _ in netif.addresses() if ":" not in addr}
    assert ours == set(ipv4_addresses())
    ipv6 = {(line.split()[1], line.split()[3].split("/")[0]) for line in ip("-o", "-6", "addr").splitlines()}
    assert {(name, addr) for name, addr, _ in netif.addresses() if ":" in addr} == ipv6


def test_an_address_of_this_host_is_reached_from_itself_on_its_interface():
    for name, addr in ipv4_addresses():
        assert netif.route_source(addr) == addr
        assert netif.interface_of(addr) == name
        assert netif.owns(addr)


def test_the_route_to_the_gateway_is_the_one_the_kernel_reports():
    default = ip("-4", "route", "show", "default").split()
    if "via" not in default:
        pytest.skip("this host has no IPv4 default route")
    gateway = default[default.index("via") + 1]
    got = ip("-4", "route", "get", gateway).split()
    src, dev = got[got.index("src") + 1], got[got.index("dev") + 1]
    assert netif.route_source(gateway) == src
    chosen = netif.choose(gateway, spans_nodes=True, environ={})
    assert (chosen.name, chosen.addr, chosen.source) == (dev, src, "route")
    assert not netif.owns(gateway)


def test_use_interface_sets_both_variables_for_the_workers_and_says_it_chose():
    name, addr = next(((n, a) for n, a in ipv4_addresses() if not a.startswith("127.")), (None, None))
    if name is None:
        pytest.skip("this host has no IPv4 address besides loopback")
    env: dict[str, str] = {}
    chosen = netif.use_interface(addr, spans_nodes=True, environ=env)
    assert env["GLOO_SOCKET_IFNAME"] == name and env["NCCL_SOCKET_IFNAME"] == f"={name}"
    assert netif.current(env) == chosen == netif.Interface(name, addr, "route")
    assert netif.current(env).describe() == f"iface={name} addr={addr} iface_from=route"
    assert netif.use_interface(addr, spans_nodes=True, environ=env) == chosen  # a worker of that agent


@pytest.mark.parametrize("var", ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_the_users_interface_wins(var):
    env = {var: "lo"}
    chosen = netif.use_interface("192.0.2.77", spans_nodes=True, environ=env)
    assert env == {var: "lo"}
    assert (chosen.name, chosen.addr, chosen.source) == ("lo", "127.0.0.1", "user")


def test_a_user_interface_that_does_not_exist_is_a_user_error():
    with pytest.raises(UserError, match="GLOO_SOCKET_IFNAME=nosuch0 names no interface of this host"):
        netif.choose("192.0.2.77", spans_nodes=True, environ={"GLOO_SOCKET_IFNAME": "nosuch0"})


@pytest.mark.parametrize(
    ("master", "spans_nodes"), [("127.0.0.1", True), ("localhost", True), ("::1", True), ("10.0.0.1", False)]
)
def test_nothing_is_chosen_for_one_node_or_a_loopback_master(master, spans_nodes):
    env: dict[str, str] = {}
    chosen = netif.use_interface(master, spans_nodes=spans_nodes, environ=env)
    assert env == {} and (chosen.name, chosen.source) == ("default", "default")
    assert chosen.addr == netif.host_address()


def test_a_master_that_does_not_resolve_depends_on_what_the_host_name_resolves_to():
    own = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    if netif.is_loopback(own):  # gloo would advertise loopback: say so, in one line, with the fix
        with pytest.raises(UserError) as err:
            netif.choose("no-such-host.invalid", spans_nodes=True, environ={})
        assert f"resolves to the loopback address {own}" in err.value.what
        assert "GLOO_SOCKET_IFNAME" in err.value.hint and "/etc/hosts" in err.value.hint
    else:  # gloo's own choice (the host name's address) is left alone
        assert netif.choose("no-such-host.invalid", spans_nodes=True, environ={}) == netif.Interface(
            "default", own, "default"
        )


@pytest.mark.parametrize(
    ("addr", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.1.2.3", False),
        ("nodea", False),
    ],
)
def test_is_loopback(addr, loopback):
    assert netif.is_loopback(addr) is loopback


def test_a_c10d_endpoint_on_this_host_is_hosted_here_by_name():
    for _, addr in ipv4_addresses():
        expected = "localhost:29400" if not addr.startswith("127.") else f"{addr}:29400"
        assert netif.hosted_endpoint(f"{addr}:29400") == expected
    assert netif.hosted_endpoint("localhost:29400") == "localhost:29400"
    assert netif.hosted_endpoint("192.0.2.77:29400") == "192.0.2.77:29400"  # someone else's
