"""What the system fixtures build, and how it is taken down again, even after an interrupted session.

Every session records what it makes (daemons, network namespaces, links) in a state folder under
STATE_ROOT *before* making it. A session that ends normally, or on SIGINT/SIGTERM/SIGHUP (turned into
KeyboardInterrupt so pytest runs its finalisers), removes it all; whatever a killed session (SIGKILL, power
loss) left behind is swept at the start of the next one: state folders whose owner process is gone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

STATE_ROOT = Path("/tmp/ddpkit-system")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


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
        folder = STATE_ROOT / f"{os.getpid()}-{secrets.token_hex(3)}"  # the owner's pid in the name
        folder.mkdir()
        return cls(folder)

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
        session = Session(folder)
        if folder.is_dir() and not (
            session.owner and _alive(session.owner) and "pytest" in _cmdline(session.owner)
        ):
            removed += session.cleanup()
    return removed
