"""Which network interface the process group talks over when a job spans nodes.

Without GLOO_SOCKET_IFNAME, gloo advertises the address this host's name resolves to; where /etc/hosts maps
the name to 127.0.1.1 (a Debian default) that is a loopback address and the other nodes cannot connect. So
when a job spans nodes and the user named no interface (neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME),
ddpkit picks the interface whose route reaches the master address and sets both variables to it. The user's
variables always win. On the master node itself, whose own name may resolve to loopback, the route to the
master is the loopback device: there the interface of the default route (or the only interface that is up,
not loopback and has an address) is taken. Linux only: elsewhere nothing is chosen, and only a host name
that resolves to loopback is reported.
"""

from __future__ import annotations

import array
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpkit import channels
from ddpkit.errors import UserError

USER_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
CHOSEN_VAR = channels.IFACE_CHOSEN  # "IFACE ADDR": what ddpkit chose, so workers can tell it from the user's
_SIOCGIFCONF, _SIOCGIFFLAGS = 0x8912, 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union


@dataclass(frozen=True)
class Interface:
    """The interface the process group uses, its address, and who decided: route, user or default."""

    name: str
    addr: str
    source: str  # route | user | default

    def describe(self) -> str:
        return f"iface={self.name} addr={self.addr or '?'} iface_from={self.source}"


def is_loopback(addr: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (and IPv4-mapped loopback)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def route_source(host: str) -> str | None:
    """The local address the kernel sends from to reach `host` (a UDP connect sends nothing); None when the
    host does not resolve here or no route reaches it."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0].split("%")[0]
        except OSError:
            continue
    return None


def host_address() -> str:
    """The address this host's name resolves to (what gloo advertises without GLOO_SOCKET_IFNAME); '' if none."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ""
    return infos[0][4][0] if infos else ""


def _flags(sock: socket.socket, name: str) -> int:
    import fcntl

    try:
        req = struct.pack("16sh22x", name.encode()[:15], 0)
        return struct.unpack("16sh", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, req)[:18])[1]
    except OSError:
        return 0


def addresses() -> list[tuple[str, str, int]]:
    """(interface, address, flags) for every address of this host's interfaces, IPv4 then IPv6 (Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    import fcntl

    out: list[tuple[str, str, int]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        size = _IFREQ_SIZE * 256
        buf = array.array("B", bytes(size))
        req = struct.pack("iL", size, buf.buffer_info()[0])
        used = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, req))[0]
        data = buf.tobytes()[:used]
        for i in range(0, used, _IFREQ_SIZE):
            label = data[i : i + 16].split(b"\0", 1)[0].decode()
            name = label.split(":", 1)[0]  # eth0:1 is an address label of eth0
            out.append((name, socket.inet_ntoa(data[i + 20 : i + 24]), _flags(s, name)))
        try:
            lines = Path("/proc/net/if_inet6").read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            fields = line.split()
            if len(fields) == 6:
                addr = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                out.append((fields[5], addr, _flags(s, fields[5])))
    return out


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds `addr`."""
    return next((name for name, a, _ in addresses() if a == addr), None)


def _default_route_iface() -> str | None:
    try:
        rows = [line.split() for line in Path("/proc/net/route").read_text().splitlines()[1:]]
    except OSError:
        return None
    best = sorted((int(r[6]), r[0]) for r in rows if len(r) > 7 and r[1] == "00000000" and r[7] == "00000000")
    return best[0][1] if best else None


def _outward_interface() -> tuple[str, str] | None:
    """(interface, IPv4 address) the other nodes most likely reach this one by: the default route's, else the
    only interface that is up, not loopback and has an IPv4 address."""
    up = [
        (name, a)
        for name, a, flags in addresses()
        if flags & _IFF_UP and not flags & _IFF_LOOPBACK and ":" not in a
    ]
    default = _default_route_iface()
    chosen = [(name, a) for name, a in up if name == default] or (up if len({n for n, _ in up}) == 1 else [])
    return chosen[0] if chosen else None


def current(environ=os.environ) -> Interface:
    """What the process group of this process uses, from the environment (for `ddpkit info`)."""
    given = environ.get("GLOO_SOCKET_IFNAME") or environ.get("NCCL_SOCKET_IFNAME")
    if not given:
        return Interface("default", host_address(), "default")
    chosen = environ.get(CHOSEN_VAR, "").split()
    if len(chosen) == 2 and chosen[0] == given:
        return Interface(given, chosen[1], "route")
    name = given.lstrip("=^").split(",")[0]
    addrs = [a for n, a, _ in addresses() if n == name]
    return Interface(given, (sorted(addrs, key=lambda a: ":" in a) or [""])[0], "user")


def _check_user_names(environ) -> None:
    names = environ.get("GLOO_SOCKET_IFNAME", "")
    if not names or not sys.platform.startswith("linux"):
        return
    have = {name for _, name in socket.if_nameindex()}
    for name in names.split(","):
        if name and name not in have:
            raise UserError(
                f"GLOO_SOCKET_IFNAME={names} names no interface of this host ({socket.gethostname()}: "
                + ", ".join(sorted(have))
                + ")",
                "set it to the interface of the cluster network (`ip -br addr` lists them) or unset it",
            )


def choose(host: str, spans_nodes: bool, environ=os.environ) -> Interface:
    """The interface for a job whose master address is `host`; UserError when this host's name resolves to
    loopback and no interface can be chosen."""
    if any(environ.get(v) for v in USER_VARS):
        _check_user_names(environ)
        return current(environ)
    if not spans_nodes or host == "localhost" or is_loopback(host):
        return Interface("default", host_address(), "default")
    src = route_source(host)
    found: tuple[str, str] | None = None
    if src is not None and not is_loopback(src):
        name = interface_of(src)
        found = (name, src) if name else None
    elif src is not None:  # the master's name resolves to loopback here: this is the master node
        found = _outward_interface()
    if found:
        return Interface(found[0], found[1], "route")
    own = host_address()
    if own and not is_loopback(own):
        return Interface("default", own, "default")
    why = "it does not resolve or has no route" if src is None else "no single outward interface"
    if not sys.platform.startswith("linux"):
        why = "interfaces are chosen on Linux only"
    raise UserError(
        f"this host's name resolves to the loopback address {own or '(none)'}; {host}: {why}",
        "set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, or map the name in /etc/hosts",
    )


def use_interface(host: str, spans_nodes: bool, environ=os.environ) -> Interface:
    """choose(), and when ddpkit chose, set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (for this process and
    the workers it starts)."""
    chosen = choose(host.strip("[]"), spans_nodes, environ)
    if chosen.source == "route":
        environ["GLOO_SOCKET_IFNAME"] = chosen.name
        environ["NCCL_SOCKET_IFNAME"] = "=" + chosen.name  # NCCL's exact match (a bare name is a prefix)
        environ[CHOSEN_VAR] = f"{chosen.name} {chosen.addr}"
    return chosen


def owns(host: str) -> bool:
    """True when `host` resolves to an address of one of this host's interfaces."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(resolved & {a for _, a, _ in addresses()})


def hosted_endpoint(endpoint: str) -> str:
    """The c10d endpoint to hand to torch: `localhost:PORT` on the node that owns the endpoint's address.

    torch's c10d rendezvous hosts its store on the node whose host *name* matches the endpoint; on a node whose
    name resolves to 127.0.1.1 an endpoint given as its network address matches no node, and every agent waits
    for a store that nobody opens. `localhost` always matches (and still lets a second agent on the same host
    join as a client).
    """
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or host == "localhost" or is_loopback(host) or not owns(host):
        return endpoint
    return f"localhost:{port}"
