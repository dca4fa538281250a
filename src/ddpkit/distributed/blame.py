"""Which rank to name when `ddpkit.launch` fails: the one that raised or died, or the one that hung — never a
rank that only timed out (or lost its connection) waiting for it. And the one-line hint for a function that
spawned processes cannot import (a lambda, a closure)."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable
from typing import Any

from ddpkit.errors import UserError, WorkerFailure

# Once a rank has failed, how long the others get to report before the launch names the culprit.
BLAME_S = 3.0
_WAITING = re.compile(
    r"timed? ?out|timeout|connection closed|connection reset|broken pipe|closed by peer", re.IGNORECASE
)


def check_importable(fn: Callable[..., Any]) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__name__", "") == "<lambda>" or "<locals>" in qualname:
        what = (
            "a lambda"
            if getattr(fn, "__name__", "") == "<lambda>"
            else f"'{qualname}', defined in a function"
        )
        raise UserError(
            f"ddpkit.launch: fn is {what}, which spawned processes cannot import",
            "define it at the top level of a module (pass its arguments after it), or use start_method='fork'",
        )


def describe_exit(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL` for a process's exit status (negative: the signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _describe(code: int | None) -> str:
    return describe_exit(code or 0)


def culprit(procs: list, values: dict[int, Any], errors: dict[int, tuple[str, str]]) -> WorkerFailure:
    """The failure to raise: a rank's own error first, then a rank that died without one, then a rank still
    running while others timed out waiting; its traceback (if any) printed once."""
    own = [r for r, (line, _) in sorted(errors.items()) if not _WAITING.search(line)]
    if own:
        r = own[0]
        print(f"--- worker rank {r} ---\n{errors[r][1]}", file=sys.stderr, flush=True)
        return WorkerFailure(f"worker rank {r} failed: {errors[r][0]}")
    done = set(values) | set(errors)
    dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode]
    if dead:
        return WorkerFailure(f"worker rank {dead[0]} died ({_describe(procs[dead[0]].exitcode)})")
    hung = [r for r, p in enumerate(procs) if r not in done and p.is_alive()]
    waiting = ", ".join(str(r) for r in sorted(errors))
    if hung:
        return WorkerFailure(
            f"worker rank {hung[0]} hung: rank {waiting} timed out waiting for it ({errors[min(errors)][0]})"
        )
    r = min(errors)
    print(f"--- worker rank {r} ---\n{errors[r][1]}", file=sys.stderr, flush=True)
    return WorkerFailure(f"worker rank {r} failed: {errors[r][0]}")


def stuck(procs: list, values: dict[int, Any], first: int, timeout_s: float) -> WorkerFailure:
    hung = [r for r in range(len(procs)) if r not in values]
    ranks = ", ".join(str(r) for r in hung)
    return WorkerFailure(
        f"worker rank {ranks} hung: still running {timeout_s:g} s (timeout_s) after rank {first} finished"
    )
