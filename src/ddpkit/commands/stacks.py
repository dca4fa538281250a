"""`ddpkit stacks [PID]`: the Python stack of every rank of a running ddpkit job, each line prefixed `[rankN]:`.

It finds the job folders that ddpkit launchers of this user keep while their workers run (diagnostics/stacks.py),
sends each running rank SIGUSR2 (faulthandler dumps every thread's stack) and prints the dumps. PID picks one
launcher (default: every one on this host). `kill -USR2 LAUNCHER_PID` prints the same on the launcher's stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ddpkit.commands import CommandParser
from ddpkit.diagnostics.stacks import (
    JOB_PREFIX,
    collect_stacks,
    launcher_alive,
    live,
    prefixed,
    sweep_stale_jobs,
)
from ddpkit.errors import UserError

_JOB = re.compile(rf"^{re.escape(JOB_PREFIX)}(\d+)-")


def jobs(pid: int | None = None) -> dict[int, Path]:
    """{launcher pid: job folder} of this user's live ddpkit launchers (`pid`: only that one)."""
    found = {}
    for path in Path(tempfile.gettempdir()).glob(f"{JOB_PREFIX}*"):
        m = _JOB.match(path.name)
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and launcher_alive(path) and pid in (None, int(m.group(1))):
            found[int(m.group(1))] = path
    return found


def stacks_command(argv: Sequence[str]) -> int:
    """Print every running rank's stack, job by job."""
    p = CommandParser(prog="ddpkit stacks", description=__doc__.splitlines()[0])
    p.add_argument("pid", nargs="?", type=int, metavar="PID", help="the launcher's pid (default: every one)")
    args: argparse.Namespace = p.parse_args(list(argv))
    sweep_stale_jobs()  # folders of launchers that were killed: their pids may be another process's now
    found = jobs(args.pid)
    if not found:
        which = f"with pid {args.pid} " if args.pid is not None else ""
        raise UserError(
            f"no ddpkit launcher {which}with running workers was found for this user on this host",
            "start it with `ddpkit run/train --nproc-per-node N`; one rank's stack: kill -USR2 PID",
        )
    for pid, job in sorted(found.items()):
        ranks = live(job)
        print(f"ddpkit job of launcher pid {pid}: {len(ranks)} running rank(s)", flush=True)
        if ranks:
            print(prefixed(collect_stacks(job, ranks)), flush=True)
    return 0
