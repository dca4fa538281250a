"""The one error type for user mistakes; the CLI turns it into `ddpkit: error: ...` and exit 2."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: bad config, bad flag, missing data, impossible launch.

    `hint` says how to fix it; the CLI prints `ddpkit: error: WHAT (HINT)`.
    """

    exit_code = 2

    def __init__(self, what: str, hint: str | None = None):
        self.what = what
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.what} ({self.hint})" if self.hint else self.what


class WorkerFailure(Exception):
    """One or more workers of a launched job failed; names the ranks."""

    exit_code = 1


class Preempted(Exception):
    """The run stopped at a step boundary on SIGTERM/SIGUSR1 after checkpointing.

    `signum`: the signal the launcher itself received, when that is what stopped the workers.
    """

    exit_code = 3

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


def first_line(e: BaseException | str, limit: int = 200, joined: bool = False) -> str:
    """The first line of an exception's message (or the whole message on one line when `joined`), at most
    `limit` characters; the exception's type name when it has no message."""
    text = str(e).strip()
    if not text:
        return type(e).__name__ if isinstance(e, BaseException) else ""
    line = " ".join(text.split()) if joined else text.splitlines()[0]
    return line if len(line) <= limit else line[:limit] + " ..."
