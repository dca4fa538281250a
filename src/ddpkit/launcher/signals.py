"""Signals between the launcher and its workers: stop requests go on to the workers, and no worker outlives
the launcher.

- The launcher (`ddpkit train/run --nproc-per-node N`) passes SIGTERM, SIGUSR1 and SIGINT on to its workers
  and keeps waiting for them, so the job ends with the workers' own status (3 after a checkpoint); a second
  SIGINT kills the workers at once.
- Each worker asks the kernel to SIGKILL it when its parent ends (Linux's parent-death signal): the launcher,
  or under a warm start the fork server, which itself dies with the launcher. A launcher killed with SIGKILL
  therefore leaves no worker behind.

A user's script under `ddpkit run` sets that up through launcher/usermain.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ddpkit import channels
from ddpkit.distributed.reaper import children as _children

PARENT_VAR = channels.LAUNCHER_PID  # set by the launcher for its workers; each worker takes it out
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# What torch's elastic agent still handles itself (its own shutdown: the signal passed on to the workers,
# then the launcher ends); SIGTERM and SIGINT are the Forwarder's, so that the job ends with the workers' status.
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def launcher_env() -> Iterator[None]:
    """While workers start: they learn this process's pid from the environment they inherit. Put back after,
    so that a process started later by this one (a library user's process that launched once, a test runner)
    is not taken for a worker."""
    old = os.environ.get(PARENT_VAR)
    os.environ[PARENT_VAR] = str(os.getpid())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(PARENT_VAR, None)
        else:
            os.environ[PARENT_VAR] = old


def alive(pid: int) -> bool:
    """Whether process `pid` exists (also one we may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int) -> None:
    """Linux: the kernel SIGKILLs this process when `parent`, its parent process, ends; already gone: exit now.
    A process whose parent is some other live process (started through a shell, srun, ...) is left alone."""
    if not sys.platform.startswith("linux") or parent == os.getpid():
        return
    if os.getppid() != parent and alive(parent):
        return  # not started by `parent` itself: not its worker
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent:  # it ended before we asked: nobody waits for us any more
        os._exit(128 + signal.SIGKILL)


def die_with_launcher() -> None:
    """In a worker the launcher started itself: die with it (no-op elsewhere). Takes PARENT_VAR out of the
    environment, so that processes this one starts are not taken for workers."""
    pid = os.environ.pop(PARENT_VAR, None)
    if pid is not None and pid.isdigit():
        die_with_parent(int(pid))


def worker_pids(launcher: int | None = None) -> list[int]:
    """The workers of `launcher` (default: this process): its child processes, or its fork server's
    (multiprocessing's resource tracker and fork server are helpers, not workers)."""
    pids = []
    for pid in _children(os.getpid() if launcher is None else launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline:
            pids += _children(pid)
        elif b"multiprocessing.resource_tracker" not in cmdline:
            pids.append(pid)
    return pids


class Forwarder:
    """In the launcher, while it waits for its workers: SIGTERM, SIGUSR1 and SIGINT are sent on to the workers
    (a stop request) instead of ending the launcher; a second SIGINT SIGKILLs them and raises
    KeyboardInterrupt. `signum`: the last signal forwarded (0: none)."""

    def __init__(self, pids: Callable[[], list[int]] = worker_pids):
        self.pids, self.signum = pids, 0
        self._old: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self) -> Forwarder:
        self._watch_waits()  # first: a signal caught from the next line on is seen by the thread
        for sig in FORWARDED:
            with contextlib.suppress(ValueError):  # not the main thread: nothing reaches us here
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _watch_waits(self) -> None:
        """A Python signal handler runs only when the main thread is back in the interpreter; waiting for the
        other nodes in a rendezvous it is inside torch's store (C++) for minutes. The C-level handler writes
        each signal's number to the wakeup fd at once: a thread reading it ends a launcher that has no worker
        yet (nothing to forward to) right away, with one line."""
        import threading

        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)
        threading.Thread(target=self._read_wakeups, args=(r,), name="ddpkit-signal-wait", daemon=True).start()

    def _read_wakeups(self, r: int) -> None:
        while True:
            try:
                got = os.read(r, 64)
            except OSError:
                return
            if not got:
                return
            for signum in got:
                if signum in FORWARDED and not self.pids():
                    name = signal.Signals(signum).name
                    with contextlib.suppress(OSError, ValueError):
                        print(
                            f"ddpkit: received {name} before any worker started (waiting for the other nodes "
                            "at the rendezvous); stopped",
                            file=sys.stderr,
                            flush=True,
                        )
                    os._exit(128 + signum)

    def _send(self, signum: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def _handle(self, signum: int, frame) -> None:
        again = signum == signal.SIGINT and self.signum == signal.SIGINT
        self.signum = signum
        if again:
            self._send(signal.SIGKILL)
            raise KeyboardInterrupt
        self._send(signum)

    def __exit__(self, *exc) -> None:
        if self._wakeup is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._old_wakeup)
            for fd in reversed(self._wakeup):  # the write end first: the reading thread sees the end
                os.close(fd)
            self._wakeup = None
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
