"""Imported inside the fork server only (the first module of warm_start's preload list), before torch.

It remembers the environment the server started with, so a worker can tell the variables the elastic agent
gave it from the server's own, and it holds back the signals a job receives as a whole (SIGTERM, SIGUSR1, ...
sent to the process group): the server must outlive its workers, whose parent it is, and each worker takes
them back as its first step (warm_start.worker), receiving any that arrived in between. The server dies
with the launcher (the kernel's parent-death signal), and each worker with the server.

The server is the workers' parent, so only it learns how each one ended; the launcher cannot wait for its
grandchildren. It writes each worker's exit status into the launcher's folder (channels.WORKER_EXITS) as it
reaps it, so a job whose rank was killed can name that rank and its signal (`rank 5 was killed by SIGKILL`).
"""

from __future__ import annotations

import os
import signal

from ddpkit import channels
from ddpkit.launcher import signals

BASE_ENV = dict(os.environ)
HELD = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}
SERVER_PID = os.getpid()  # a worker's parent
EXITS = BASE_ENV.get(channels.WORKER_EXITS)
WAITPID = os.waitpid  # multiprocessing's server loop reaps its children with it


def _recording_waitpid(pid: int, options: int) -> tuple[int, int]:
    """os.waitpid, writing each reaped child's exit status (negative: the signal) to EXITS/PID."""
    found, status = WAITPID(pid, options)
    if found > 0 and EXITS:
        try:
            with open(os.path.join(EXITS, str(found)), "w") as fh:
                fh.write(str(os.waitstatus_to_exitcode(status)))
        except (OSError, ValueError):
            pass
    return found, status


os.waitpid = _recording_waitpid  # in this server only: each worker puts the original back (warm_start.worker)

signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
if BASE_ENV.get(signals.PARENT_VAR, "").isdigit():
    signals.die_with_parent(int(BASE_ENV[signals.PARENT_VAR]))
