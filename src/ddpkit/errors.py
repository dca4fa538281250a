"""The exceptions that end a ddpkit command; the CLI turns each into one line on stderr and its exit code.

UserError: a mistake the user can fix (exit 2). Failure and its kinds: a run that could not go on, or stopped
on request (WorkerFailure and TrainingFailure exit 1, Preempted exits 3). Each says whether this process prints
its line (`report`), so a job of N ranks prints one line, not N.
"""

from __future__ import annotations

import contextlib
import re
import warnings


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
        return escaped(f"{self.what} ({self.hint})" if self.hint else self.what)


LINE_LIMIT = 200  # the most characters of an error line, besides the paths it names


def _paths(text: str) -> int:
    """How many characters of `text` are paths: quoted ones with a slash, or bare absolute ones."""
    return sum(len(m) for m in re.findall(r"'[^']*/[^']*'|(?<![\w'])/[^\s']+", text))


def printed(prefix: str, e: UserError) -> str:
    """The text the CLI prints for `e`: `PREFIX WHAT (HINT)` on one line, or, when that is over LINE_LIMIT
    characters besides its paths, the advice on a second line (`  (HINT)`)."""
    line = prefix + e.line()
    if e.hint is None or len(line) - _paths(line) <= LINE_LIMIT:
        return line
    return f"{prefix}{escaped(e.what)}\n  ({escaped(e.hint)})"


def escaped(text: str) -> str:
    """`text` safe to print on a terminal as one line: every non-printable character (ESC, DEL, a newline, \\x01,
    ...) written as its Python escape, so a path cannot set a terminal's title or clear its screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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


class CollectiveFailure(WorkerFailure):
    """This rank gave up on a collective (a peer died, hung or was cut off): not the job's cause. Under ddpkit's
    launcher its line goes to log.txt and the launcher's job folder, and the launcher's one line names the cause."""


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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: str | None) -> str:
    """`12.0 MiB free on /mnt/x` for the file system holding `path` (its nearest existing folder); '' if unknown."""
    import os
    import shutil

    if not path:
        return ""
    folder = os.path.abspath(path)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return f"{_size(shutil.disk_usage(folder).free)} free on {folder}"
    except OSError:
        return ""


def describe_os_error(e: OSError) -> tuple[str, str]:
    """(what, how to fix) for a failed read or write: the path, the real cause, and for a full disk its free space."""
    import errno
    import resource

    path = e.filename
    where = f" '{path}'" if path else ""
    cause = e.strerror or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_space(path)
        return (
            cause.lower() + (f" writing{where}" if path else "") + (f" ({free})" if free else ""),
            "free some space or choose an out_dir on another disk, then rerun the same command to continue",
        )
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = f" (this process may write files of at most {_size(limit)}: `ulimit -f`)" if limit > 0 else ""
        what = "file too large" + (f" writing{where}" if path else "")
        return what + shown, "raise the file size limit (`ulimit -f unlimited`)"
    if e.errno == errno.EROFS:
        return (
            f"{where.strip() or 'a file'} is on a read-only file system",
            "choose an out_dir on a writable disk",
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied:{where}", "give this user write access to it or choose another out_dir"
    if e.errno == errno.ENOTDIR:
        return f"a part of the path{where} is a file, not a folder", "choose a path whose folders are folders"
    if e.errno == errno.EISDIR:
        return f"{where.strip()} is a folder, not a file", "give the path of a file"
    if e.errno == errno.EIO:
        return f"input/output error on{where}", "the disk or network file system failed: check it, then rerun"
    return f"{cause}:{where}" if where else cause, "check the file and the disk it is on, then rerun"


@contextlib.contextmanager
def held_warnings():
    """Python warnings raised inside (torch's about a file it reads: "Detected pickle protocol 4") are shown only
    when the block succeeds: a file ddpkit refuses gets its one line, not the warnings about it first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:  # the block succeeded: they are shown as they would have been
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
