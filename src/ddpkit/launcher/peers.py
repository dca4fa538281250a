"""What a node's launcher (torch's elastic agent, in this process) learns about the other nodes of a job.

Two things torch's agent does not say by itself on a multi-node c10d job:
- which node went missing: its rendezvous only logs, at debug level, the nodes it drops for lack of keep-alives;
  `watch()` collects those names and `name_lost_nodes()` turns the rendezvous time-out into a failure that
  names them (exit 1: a node was lost, not a mistake in the command);
- that it is stuck: across a network partition a call to the rendezvous store blocks until TCP gives up (about
  15 minutes), long after this node's workers have failed. `watch()` starts a thread that, once no worker of
  this agent is alive and the store has not answered a connection for STORE_SILENCE_S, prints one line naming
  the store's address and ends the process (exit 1).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

from ddpkit import channels
from ddpkit.errors import UserError, WorkerFailure
from ddpkit.launcher.signals import worker_pids

RDZV_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
STORE_SILENCE_S = 10.0  # no worker alive and no answer from the store for this long: the agent is stuck
_DEAD = re.compile(r"Detected dead node '(.+?)_(\d+)_\d+'")


class _LostNodes(logging.Handler):
    """Collects the nodes torch's c10d rendezvous drops for lack of keep-alives: {host name: agent pid}."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lost: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = _DEAD.search(record.getMessage())
        if m:
            self.lost[m[1]] = m[2]


_LOST = _LostNodes()


def _live_children() -> list[int]:
    """This agent's workers that have not exited (an agent stuck in a store call reaps nobody): its children, or
    its fork server's (the fork server itself lives on and is not a worker)."""
    return [p for p in worker_pids() if _state(p) not in ("Z", "X", "")]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _store_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _watch_store(endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    seen_workers, silent_since = False, None
    while True:
        time.sleep(0.5)
        workers = _live_children()
        seen_workers = seen_workers or bool(workers)
        if workers or not seen_workers or _store_answers(host, int(port)):
            silent_since = None
            continue
        silent_since = silent_since or time.monotonic()
        if time.monotonic() - silent_since >= STORE_SILENCE_S:
            print(
                f"ddpkit: error: this node ({socket.gethostname()}) lost the rendezvous store at {endpoint}: "
                f"its workers have stopped and the store has not answered for {STORE_SILENCE_S:.0f} s, so the node "
                "that runs it is unreachable or stopped (check the network between the nodes; when it is back, "
                "rerun the same command on every node: training resumes from the last checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def watch(endpoint: str, nnodes: int) -> None:
    """On a multi-node job: collect the names of lost nodes, and end a launcher stuck on a lost store."""
    if nnodes < 2:
        return
    logger = logging.getLogger(RDZV_LOGGER)
    if _LOST not in logger.handlers:
        if not os.environ.get(channels.DEBUG):  # keep its debug lines to ourselves
            logger.propagate = False
            quiet = logging.StreamHandler()
            quiet.setLevel(logging.ERROR)
            logger.addHandler(quiet)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(_LOST)
    if sys.platform.startswith("linux"):  # the watchdog finds this agent's workers in /proc
        threading.Thread(
            target=_watch_store, args=(endpoint,), name="ddpkit-store-watch", daemon=True
        ).start()


def name_lost_nodes(err: Exception) -> Exception:
    """A rendezvous time-out after nodes left the job -> a WorkerFailure (exit 1, not a user error) naming them;
    anything else unchanged."""
    if not isinstance(err, UserError) or "joined the rendezvous" not in err.what or not _LOST.lost:
        return err
    lost = ", ".join(
        f"{host} (its launcher, pid {pid}, stopped answering)" for host, pid in _LOST.lost.items()
    )
    return WorkerFailure(
        f"{err.what}; lost: {lost} (restart the launcher on {', '.join(_LOST.lost)} with the same command, "
        "and training resumes from the last checkpoint)"
    )
