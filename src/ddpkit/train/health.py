"""Heartbeats in the rendezvous store, so a collective that times out can say which rank fell behind.

Each rank's background thread writes `step time` under `ddpkit/hb/RANK` every few seconds. A thread, not the
training loop: a rank that is SIGSTOPped or dead stops beating, while a rank merely waiting in a collective
keeps beating, which is exactly the difference the message has to explain.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch.distributed as dist

from ddpkit.distributed import runtime
from ddpkit.errors import CollectiveFailure, first_line

KEY = "ddpkit/hb/{rank}"
# Words in an exception that mean a peer died or stalled (as opposed to a bug in this rank).
COMM_FAILURE_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket", "store")
# Every heartbeat of this process still beating, so the runtime's teardown can stop them before the group goes.
_LIVE: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no process group, or a backend without a store
        return None


class Heartbeat:
    """Publish this rank's progress; diagnose the others' after a failed collective.

    Whoever makes one owns it: pass it to what needs it and close it (or use it as a context manager).
    """

    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.step = 0
        self.hosts: dict[int, str] = {}  # rank -> host name, as the ranks' beats say
        self._host = socket.gethostname()
        self._unreachable = False  # the store stopped answering: close() then does not wait for the thread
        self._stop = threading.Event()
        self._store = (
            _default_store() if dist.is_available() and dist.is_initialized() and world_size > 1 else None
        )
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._run, name="ddpkit-heartbeat", daemon=True)
            self._thread.start()
            _LIVE.add(self)
            atexit.register(self.close)  # also when the caller never closes it (library use)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _beat(self) -> None:
        self._store.set(KEY.format(rank=self.rank), f"{self.step} {time.time():.3f} {self._host}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat()
            except Exception:  # the store's host is gone: nothing left to report to
                return
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        """Stop beating and wait for the thread to leave the store.

        The wait matters: a daemon thread still inside a store call when the interpreter exits is killed
        mid-C++-call, and the process aborts (SIGABRT) after training succeeded.
        """
        self._stop.set()
        _LIVE.discard(self)
        if self._unreachable:  # the thread is stuck in a store call that only TCP will end
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 10)

    def read(self) -> dict[int, tuple[int, float]]:
        """{rank: (step, seconds since its last beat)} for every rank that has beaten."""
        out: dict[int, tuple[int, float]] = {}
        if self._store is None:
            return out
        self._store.set_timeout(datetime.timedelta(seconds=5))
        now = time.time()
        for r in range(self.world_size):
            key = KEY.format(rank=r)
            try:
                if not self._store.check([key]):
                    continue
                step, stamp, *host = self._store.get(key).decode().split()
                out[r] = (int(step), now - float(stamp))
                self.hosts[r] = host[0] if host else "?"
            except Exception:
                continue
        return out

    def diagnose(self, within_s: float = 5.0) -> str:
        """Which ranks fell behind and where, in words (empty when nothing can be said); never waits longer
        than `within_s` for the store (across a network partition a store call blocks until TCP gives up)."""
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(self._diagnose()), daemon=True)
        reader.start()
        reader.join(within_s)
        if said:
            return said[0]
        self._unreachable = True
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return f"the store at {where} did not answer within {within_s:.0f} s: that node is unreachable or stopped"

    def _diagnose(self) -> str:
        beats = self.read()
        if self._store is None:
            return ""
        if not beats:
            return (
                "no rank's heartbeat could be read (the rendezvous store's host may be the rank that stopped)"
            )
        silent = [r for r in range(self.world_size) if r not in beats]
        stale = sorted(r for r, (_, age) in beats.items() if age > 3 * self.interval_s + 1)
        parts = [
            f"rank {r} on {self.hosts.get(r, '?')} (last heartbeat at step {beats[r][0]}, {beats[r][1]:.0f} s ago)"
            for r in stale
        ]
        parts += [f"rank {r} (never sent a heartbeat)" for r in silent]
        if not parts:  # everyone alive: name the ones furthest behind
            low = min(step for step, _ in beats.values())
            if any(step != low for step, _ in beats.values()):
                behind = [r for r, (step, _) in beats.items() if step == low]
                parts = [f"rank {r} (at step {low})" for r in behind]
        return ("stopped responding: " + ", ".join(parts)) if parts else ""


def stop_heartbeat() -> None:
    """Stop every heartbeat this process still runs (the runtime calls it before the process group goes away)."""
    for heartbeat in list(_LIVE):
        heartbeat.close()


runtime.BEFORE_SHUTDOWN.append(stop_heartbeat)


def _comm_failure(e: BaseException) -> BaseException | None:
    """The failed collective behind `e` (itself, or what it was raised from: a pipeline stage wraps it in
    "[Stage 1] failed to run forward"), or None when `e` is not one."""
    for _ in range(5):
        if isinstance(e, (RuntimeError, OSError)) and any(w in str(e).lower() for w in COMM_FAILURE_WORDS):
            return e
        if e.__cause__ is None and e.__context__ is None:
            return None
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def explain_comm_failures(
    ctx, heartbeat: Heartbeat, step: Callable[[], int], log: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Turn a failed collective into a CollectiveFailure naming the rank(s) that fell behind and the step (also
    given to `log`: log.txt)."""
    try:
        yield
    except (RuntimeError, OSError) as e:
        cause = _comm_failure(e) if ctx.world_size > 1 else None
        if cause is None:
            raise
        why = heartbeat.diagnose()
        line = f"rank {ctx.rank} gave up on a collective at step {step()} ({first_line(cause, limit=70)})"
        line += f"; {first_line(why, limit=80)}" if why else ""
        if log is not None:
            log(line)
        raise CollectiveFailure(line) from None
