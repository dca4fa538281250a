"""What the system fixtures build, and how it is taken down again, even after an interrupted session.

Every session records what it makes (daemons, network namespaces, links) in a state folder under
STATE_ROOT *before* making it. A session that ends normally, or on SIGINT/SIGTERM/SIGHUP (turned into
KeyboardInterrupt so pytest runs its finalisers), removes it all; whatever a killed session (SIGKILL, power
loss) left behind is swept at the start of the next one: state folders whose owner process is gone.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from conftest import cli_env
from ddpkit.launcher.signals import alive

from .helpers import PY

STATE_ROOT = Path("/tmp/ddpkit-system")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


_alive = alive


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start_time(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22); -1 if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _kill(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace` seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) and not _zombie(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Session:
    """The state folder of one pytest session: what it made, so that anyone can remove it."""

    def __init__(self, folder: Path):
        self.dir = folder
        self.log = folder / "resources.jsonl"

    @classmethod
    def create(cls) -> Session:
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(3)}"  # the owner's pid in the name
        making = STATE_ROOT / f".{name}"  # not a session folder until it holds its owner's start time
        making.mkdir()
        (making / "owner").write_text(str(_start_time(os.getpid())))  # tells the owner from a reused pid
        making.rename(STATE_ROOT / name)
        return cls(STATE_ROOT / name)

    def owner_alive(self) -> bool:
        """Whether the process that made this session still runs: its pid, started when the owner started
        (a pytest process, or a pytest-xdist worker, whose command line does not say pytest)."""
        if not (self.owner and _alive(self.owner)):
            return False
        try:
            return int((self.dir / "owner").read_text()) == _start_time(self.owner)
        except (OSError, ValueError):  # a folder of an older session: its command line must say pytest
            return "pytest" in _cmdline(self.owner)

    @property
    def owner(self) -> int:
        head = self.dir.name.split("-", 1)[0]
        return int(head) if head.isdigit() else 0

    @property
    def tag(self) -> str:
        return self.dir.name.rsplit("-", 1)[1]

    def record(self, kind: str, value: str | int) -> None:
        """Note a resource (netns, link, proc) before it is made."""
        with open(self.log, "a") as fh:
            fh.write(json.dumps({kind: value}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def resources(self, kind: str) -> list:
        try:
            rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        except OSError:
            return []
        return [r[kind] for r in rows if kind in r]

    def cleanup(self) -> list[str]:
        """Remove everything recorded (any order of earlier partial cleanups is fine); what was removed."""
        done: list[str] = []
        procs = [p for p in self.resources("proc") if _alive(p) and str(self.dir) in _cmdline(p)]
        namespaces = self.resources("netns")
        existing = set(_ip("netns", "list").stdout.split())
        in_ns = [
            int(p) for ns in namespaces if ns in existing for p in _ip("netns", "pids", ns).stdout.split()
        ]
        if procs or in_ns:
            _kill(procs + in_ns)
            done += [f"process {p}" for p in procs + in_ns]
        for ns in namespaces:
            if ns in existing and _ip("netns", "del", ns).returncode == 0:
                done.append(f"netns {ns}")
        for link in self.resources("link"):
            if _ip("link", "del", link).returncode == 0:
                done.append(f"link {link}")
        shutil.rmtree(self.dir, ignore_errors=True)
        return done


def sweep() -> list[str]:
    """Remove what sessions whose pytest process is gone left behind; what was removed."""
    removed: list[str] = []
    if not STATE_ROOT.is_dir():
        return removed
    for folder in sorted(STATE_ROOT.iterdir()):
        if folder.name.startswith("."):  # a session folder being made (it holds no resource yet)
            pid = folder.name[1:].split("-", 1)[0]
            if not (pid.isdigit() and _alive(int(pid))):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        session = Session(folder)
        if folder.is_dir() and not session.owner_alive():
            removed += session.cleanup()
    return removed


# ---------------------------------------------------------------------------------------------- two hosts


class NetworkUnavailable(Exception):
    """This host cannot make namespaces or bridges (not root, a container without the capability, ...)."""


@dataclass(frozen=True)
class NetnsPair:
    """Two network namespaces, each a "host" with its own address on one bridge of this host.

    Inside node i the link is `ifname` with `addrs[i]`; its host name is `hosts[i]`, which its /etc/hosts maps
    to 127.0.1.1 (the Debian default that makes gloo advertise a loopback address) while the other node's name
    maps to that node's address. `peers[i]` is the link's end on this host: down cuts node i off.
    """

    names: tuple[str, str]
    addrs: tuple[str, str]
    peers: tuple[str, str]
    host_addr: str  # this host's address on the bridge (the Slurm controller listens there)
    spare: str  # an address on the link that nobody has
    etc_hosts: tuple[str, str]  # the nodes' /etc/hosts
    hosts: tuple[str, str] = ("nodea", "nodeb")
    ifname: str = "ddpk0"

    def argv(self, node: int, *command: str) -> list[str]:
        """`command` on node 0 or 1: in its network namespace, with its /etc/hosts (a bind mount in a mount
        namespace of its own) and its own host name (a UTS namespace of its own)."""
        setup = f'mount --bind {self.etc_hosts[node]} /etc/hosts && hostname {self.hosts[node]} && exec "$@"'
        netns = f"--net=/run/netns/{self.names[node]}"
        return ["nsenter", netns, "unshare", "--mount", "--uts", "sh", "-c", setup, "sh", *command]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """cli_env: no launcher variables, and no GLOO/NCCL_SOCKET_IFNAME unless `extra` sets them."""
        env = cli_env(extra)
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DDPKIT_IFACE_CHOSEN"):
            if name not in (extra or {}):
                env.pop(name, None)
        return env

    def ddpkit(self, node: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `python -m ddpkit ARGS` on a node, in its own session (so a test can kill the whole node)."""
        argv = self.argv(node, PY, "-m", "ddpkit", *args)
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(env),
            start_new_session=True,
        )

    def link(self, node: int, up: bool) -> None:
        """Plug node i's cable in or out (its end on this host's bridge)."""
        proc = _ip("link", "set", self.peers[node], "up" if up else "down")
        assert proc.returncode == 0, proc.stderr


def _free_subnet() -> int:
    used = _ip("-o", "-4", "addr").stdout
    for n in random.sample(range(1, 255), 254):
        if f" 10.77.{n}." not in used:
            return n
    raise NetworkUnavailable("no free 10.77.N.0/24 subnet on this host")


def hosts_file(own: str, others: dict[str, str]) -> str:
    """An /etc/hosts in the Debian style: own name on 127.0.1.1, the others on their addresses."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"127.0.1.1 {own}"]
    return "\n".join(lines + [f"{addr} {name}" for name, addr in others.items()]) + "\n"


def make_pair(session: Session) -> NetnsPair:
    """Two namespaces on a bridge of this host (10.77.N.1, .2; the host is .254), lo up in each; every piece
    recorded in `session` before it is made."""
    s, n, tag = session, _free_subnet(), session.tag
    pair = NetnsPair(
        names=(f"ddpkA-{tag}", f"ddpkB-{tag}"),
        addrs=(f"10.77.{n}.1", f"10.77.{n}.2"),
        peers=(f"ddpkA{tag}", f"ddpkB{tag}"),
        host_addr=f"10.77.{n}.254",
        spare=f"10.77.{n}.9",
        etc_hosts=(str(s.dir / "hosts-a"), str(s.dir / "hosts-b")),
    )
    bridge = f"ddpkbr{tag}"
    s.record("link", bridge)
    for step in (
        ["link", "add", bridge, "type", "bridge"],
        ["addr", "add", f"{pair.host_addr}/24", "dev", bridge],
        ["link", "set", bridge, "up"],
    ):
        proc = _ip(*step)
        if proc.returncode != 0:
            raise NetworkUnavailable(
                f"cannot make a bridge here (ip {' '.join(step)}): {proc.stderr.strip()}"
            )
    controller = {socket.gethostname(): pair.host_addr}
    for i, (name, addr, peer) in enumerate(zip(pair.names, pair.addrs, pair.peers, strict=True)):
        s.record("netns", name)
        proc = _ip("netns", "add", name)
        if proc.returncode != 0:
            raise NetworkUnavailable(f"`ip netns add` is not permitted here: {proc.stderr.strip()}")
        others = {pair.hosts[1 - i]: pair.addrs[1 - i], **controller}
        Path(pair.etc_hosts[i]).write_text(hosts_file(pair.hosts[i], others))
        s.record("link", peer)
        for step in (
            ["link", "add", peer, "type", "veth", "peer", "name", pair.ifname, "netns", name],
            ["link", "set", peer, "master", bridge, "up"],
            ["-n", name, "addr", "add", f"{addr}/24", "dev", pair.ifname],
            ["-n", name, "link", "set", pair.ifname, "up"],
            ["-n", name, "link", "set", "lo", "up"],
        ):
            proc = _ip(*step)
            if proc.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {proc.stderr.strip()}")
    return pair
