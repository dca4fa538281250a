"""The exceptions that end a ddpkit command; the CLI turns each into one line on stderr and its exit code.

UserError: a mistake the user can fix (exit 2). Failure and its kinds: a run that could not go on, or stopped
on request (WorkerFailure and TrainingFailure exit 1, Preempted exits 3). Each says whether this process prints
its line (`report`), so a job of N ranks prints one line, not N.
"""

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


class Failure(Exception):
    """A run that could not go on for a reason other than the user's input; the CLI prints `prefix + message`
    when `report` is true and exits with `exit_code`."""

    exit_code = 1
    prefix = "ddpkit: error: "

    def __init__(self, message: str, *, exit_code: int | None = None, report: bool = True):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.report = report


class WorkerFailure(Failure):
    """One or more workers of a launched job failed, or this rank gave up on a collective; names the ranks."""


class TrainingFailure(Failure):
    """Training cannot go on (a non-finite loss under train.nonfinite=stop); names the rank(s) and the step."""


class Preempted(Failure):
    """The run stopped at a step boundary on SIGTERM/SIGUSR1 after checkpointing; rerunning continues it.

    `signum`: the signal that stopped it, when known.
    """

    exit_code = 3
    prefix = "ddpkit: "

    def __init__(self, message: str, *, signum: int | None = None, report: bool = True):
        super().__init__(message, report=report)
        self.signum = signum


def first_line(e: BaseException | str, limit: int = 200, joined: bool = False) -> str:
    """The first line of an exception's message (or the whole message on one line when `joined`), at most
    `limit` characters; the exception's type name when it has no message."""
    text = str(e).strip()
    if not text:
        return type(e).__name__ if isinstance(e, BaseException) else ""
    line = " ".join(text.split()) if joined else text.splitlines()[0]
    return line if len(line) <= limit else line[:limit] + " ..."
