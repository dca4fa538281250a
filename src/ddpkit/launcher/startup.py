"""Start-up time: from the command's start to the first optimizer step, split into the stages it went through.

The launcher puts its own start time in the environment (START_VAR) before it starts workers, so a worker can
measure from the moment the user's command began. Each stage ends at a mark; a stage's time is the distance
between its mark and the one before, so the parts add up to the total exactly. No torch here: the launcher
imports this module before anything heavy.
"""

from __future__ import annotations

import os
import time

from ddpkit import channels

START_VAR = channels.START_TIME  # "EPOCH_SECONDS PID": when the launcher with that pid started
# The stages, in order, each with the mark that ends it.
STAGES = (
    ("launcher", "process"),  # the launcher's imports, rendezvous and start of this worker process
    ("import", "imported"),  # this process: imports, arguments, config, checks
    ("rendezvous", "rendezvous"),  # joining the process group
    ("data", "data"),  # the data sets
    ("model", "model"),  # model, parallel wrapper, loaders, optimizer
    ("first_step", "first_step"),  # resume check, first micro-batches, forward, backward, optimizer step
)
FIELDS = ("startup_s", *(f"startup_{stage}_s" for stage, _ in STAGES))

_marks: dict[str, float] = {}
_imported_at = time.time()  # fallback for the process start where /proc cannot say
_own_start: float | None = None


def _reset_after_fork() -> None:
    global _imported_at, _own_start
    _marks.clear()
    _imported_at, _own_start = time.time(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def process_start(pid: int | str = "self") -> float | None:
    """When process `pid` started (seconds since the epoch, to a clock tick), from /proc; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5), counted after the ")" that ends the command name
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - since


def _parent(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _launched_by(pid: int) -> bool:
    """Whether process `pid` is this process's parent or one of its parent's ancestors (a few levels up)."""
    here: int | str | None = "self"
    for _ in range(4):
        here = _parent(here) if here is not None else None
        if here is None or here <= 1:
            return False
        if here == pid:
            return True
    return False


def command_start(environ=os.environ) -> float:
    """When the command began: the launcher's start when a ddpkit launcher started this process, else this
    process's own start."""
    raw = environ.get(START_VAR, "").split()
    if len(raw) == 2:
        try:
            t, pid = float(raw[0]), int(raw[1])
        except ValueError:
            pass
        else:
            if pid == os.getpid() or _launched_by(pid):
                return t
    return this_process_start()


def this_process_start() -> float:
    """When this process started (the time this module was imported where /proc is missing)."""
    global _own_start
    if _own_start is None:
        _own_start = process_start() or _imported_at
    return _own_start


def publish(environ=os.environ) -> None:
    """Tell the workers about to be started when this command began (call in the launcher)."""
    environ[START_VAR] = f"{command_start(environ):.6f} {os.getpid()}"


def mark(name: str, *, keep: bool = False) -> None:
    """Now is the end of stage mark `name` (`keep`: unless it was marked already)."""
    if not (keep and name in _marks):
        _marks[name] = time.time()


def measure() -> dict[str, float]:
    """The start-up fields (FIELDS) in seconds: the total and each stage, from the marks made so far.

    A stage whose mark is missing takes no time (the next stage starts where the previous one ended).
    """
    start = t = command_start()
    marks = {**_marks, "process": this_process_start()}
    out = {}
    for stage, name in STAGES:
        end = max(t, marks.get(name, t))
        out[f"startup_{stage}_s"] = round(end - t, 3)
        t = end
    return {"startup_s": round(t - start, 3), **out}


def describe(fields: dict[str, float]) -> str:
    """The one log line: `started in T s to the first optimizer step (launcher A, import B, ...)`."""
    parts = ", ".join(f"{stage.replace('_', ' ')} {fields[f'startup_{stage}_s']:.2f}" for stage, _ in STAGES)
    return (
        f"ddpkit: {fields['startup_s']:.2f} s from the command's start to the first optimizer step ({parts})"
    )
