"""The lock that makes one process the only writer of an out_dir, and the job identity that lets a restarted or
requeued job take its own run over.

An flock on out_dir/.ddpkit.lock holding `{"host", "pid", "job", "since"}` of its holder: the kernel drops it when
that process dies, so a crashed run never blocks the next one. `job` names the job across restarts (Slurm's job
id, torch's elastic run id, or the elastic agent's host and pid).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddpkit.atomicio import NotOwnFile, open_own
from ddpkit.errors import UserError

LOCK_NAME = ".ddpkit.lock"


def job_id() -> str | None:
    """What names this job across its restarts and requeues (None: a plain process, restarted only by hand)."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run not in ("none", "ddpkit"):  # a unique rendezvous id (torchrun --standalone, --rdzv-id)
        return f"elastic:{run}"
    if "TORCHELASTIC_RESTART_COUNT" in env:  # the agent that restarts us keeps its pid
        return f"agent:{socket.gethostname()}:{os.getppid()}"
    return None


def same_job(holder: dict[str, Any]) -> bool:
    """The holder a lock file names was a process of this job (an earlier attempt of a restarted job)."""
    job = holder.get("job")
    return job is not None and job == job_id()


_HELD: set[int] = set()


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep its parent's lock alive: close the inherited fds."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _in_use(out_dir: Path, who: dict[str, Any]) -> UserError:
    if who.get("pid"):
        since = f", since {who['since']}" if who.get("since") else ""
        holder = f" (pid {who['pid']} on host {who.get('host', '?')}{since})"
    else:
        holder = " (it is starting)"
    return UserError(
        f"out_dir '{out_dir}' is in use by another ddpkit train{holder}",
        "wait for that run to end or stop it, or choose another out_dir",
    )


def _gone(who: dict[str, Any]) -> bool:
    """The recorded holder is a process of this host that no longer runs (a child it forked may hold on)."""
    if who.get("host") != socket.gethostname() or not isinstance(who.get("pid"), int):
        return False
    try:
        os.kill(who["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


MAX_LOCK_BYTES = 4096  # what a holder writes is about 100 bytes


def _open_lock(path: Path) -> int:
    """The lock file, opened read-write without following a symlink; UserError when it is not ddpkit's."""
    try:
        fd = open_own(path, os.O_RDWR | os.O_CREAT, 0o644)
    except NotOwnFile as e:
        raise UserError(f"'{path}' is {e.strerror}", "remove it; ddpkit makes this file itself") from None
    if os.fstat(fd).st_size > MAX_LOCK_BYTES:
        os.close(fd)
        raise UserError(
            f"'{path}' is larger than a ddpkit lock file ({MAX_LOCK_BYTES} bytes)",
            "remove it; ddpkit makes this file itself",
        )
    return fd


def _whole(fd: int) -> bytes:
    """Every byte of the (small) lock file, so that an undo puts back exactly what was there."""
    return os.pread(fd, os.fstat(fd).st_size + 1, 0)


def check_free(out_dir: str | os.PathLike) -> None:
    """UserError when a live run holds out_dir (a test that writes nothing: for the launcher, before workers)."""
    out = Path(out_dir)
    try:
        fd = os.open(out / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # no lock file: nobody holds it (rank 0 reports any other trouble)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out, _holder(fd)) from None
    except OSError:
        pass
    finally:
        os.close(fd)


class RunLock:
    """An exclusive flock on out_dir/.ddpkit.lock, held by the run's only writer."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir)
        self.path = self.out / LOCK_NAME
        self.fd: int | None = None
        self._before: bytes | None = None  # the file's bytes before we wrote ours (None: we created it)

    def acquire(self, wait_s: float = 10.0) -> dict[str, Any]:
        """Take the lock and write this process into it; returns what the previous holder wrote ({} if none).

        UserError naming the holder when another live process holds it; a holder that died while a child of it
        still holds the lock is waited for up to `wait_s`.
        """
        deadline = time.monotonic() + wait_s
        while True:
            existed = os.path.lexists(self.path)
            fd = _open_lock(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder(fd)
                os.close(fd)
                if _gone(who) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise _in_use(self.out, who) from None
            except OSError as e:
                os.close(fd)
                raise UserError(
                    f"out_dir '{self.out}' is on a file system without file locks ({e.strerror})",
                    "choose an out_dir on a local disk or NFS",
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file that a run which failed its checks unlinked after we opened it
                break
            os.close(fd)
        self.fd = fd
        _HELD.add(fd)
        self._before = _whole(fd) if existed else None
        previous = _holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id()}
        self._write(json.dumps({**me, "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n")
        return previous

    def _write(self, data: bytes) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self, undo: bool = False) -> None:
        """Let go; `undo`: leave the lock file as it was before (removed when this run created it)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if undo and self._before is None and _same_file(self.fd, self.path):
                self.path.unlink(missing_ok=True)
            elif undo:
                self._write(self._before or b"")
        _HELD.discard(self.fd)
        os.close(self.fd)  # drops the flock
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    """`path` still names the file open as `fd` (so an unlink removes ours, not a file put there since)."""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def read_holder(out_dir: str | os.PathLike) -> dict[str, Any]:
    """What the lock file of out_dir says of its last holder ({} when none); reads only."""
    try:
        fd = os.open(Path(out_dir) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        return _holder(fd)
    finally:
        os.close(fd)
