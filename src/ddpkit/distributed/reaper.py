"""No process outlives a launch: while the launcher waits for its workers it is their subreaper (Linux's
PR_SET_CHILD_SUBREAPER), so a process a worker started (a DataLoader worker, a helper of the user's) that loses
its parent becomes the launcher's child instead of init's; when the launch ends, whatever is left of them is
killed. The launcher's own multiprocessing helpers (resource tracker, fork server) are left to end by
themselves."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterator
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux's /proc), of every thread of it."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def _subreaper(on: bool) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for kid in children(pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.resource_tracker" in cmdline:
            continue
        if b"multiprocessing.forkserver" in cmdline:  # the launcher's helper, which multiprocessing itself
            out += _descendants(kid)  # stops and reaps; what it forked is the job's
            continue
        out += [kid, *_descendants(kid)]
    return out


def end_leftovers() -> list[int]:
    """SIGKILL every process below this one (but its resource tracker) and reap them; their pids."""
    left = _descendants(os.getpid())
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)  # ours (a direct child or an orphan we adopted): no zombie left
    return left


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    _subreaper(True)
    try:
        yield
    finally:
        end_leftovers()
        _subreaper(False)
