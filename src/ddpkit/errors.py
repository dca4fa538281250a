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
    """The run stopped at a step boundary on SIGTERM/SIGUSR1 after checkpointing."""

    exit_code = 3
