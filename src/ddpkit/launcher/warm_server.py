"""Imported inside the fork server only (the first module of warm_start's preload list), before torch.

It remembers the environment the server started with, so a worker can tell the variables the elastic agent
gave it from the server's own, and it holds back the signals a job receives as a whole (SIGTERM, SIGUSR1, ...
sent to the process group): the server must outlive its workers, whose parent it is, and each worker takes
them back as its first step (warm_start.worker), receiving any that arrived in between. The server dies
with the launcher (the kernel's parent-death signal), and each worker with the server.
"""

from __future__ import annotations

import os
import signal

from ddpkit.launcher import signals

BASE_ENV = dict(os.environ)
HELD = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}
SERVER_PID = os.getpid()  # a worker's parent

signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
if BASE_ENV.get(signals.PARENT_VAR, "").isdigit():
    signals.die_with_parent(int(BASE_ENV[signals.PARENT_VAR]))
