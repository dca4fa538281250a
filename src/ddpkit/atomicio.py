"""Atomic file writes without torch: write a temporary file beside the target, fsync, rename over it.

Checkpoints (checkpoint/, through torch.save) and the report's pictures and tables (commands/report.py, which must not
pay for a torch import) are written this way: a reader, or a run killed mid-write, never sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it where Linux allows (/proc), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> Path:
    """write(fh) into a temporary file in path's folder, fsync, rename over path: readers never see half a file.

    A kill at any moment leaves the old file or the new one; the temporary of a killed write is swept by
    checkpoint.CheckpointDir.newest_complete.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; the file is the user's, as open() would make it
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = os_cause(e)
        if cause is not None:  # a full disk, a size limit, ...: name the file (torch's writer names nothing)
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise
    fsync_dir(path.parent)
    return path


def os_cause(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: `e` itself, or what torch's zip writer turned into `unexpected pos`."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = (e.__cause__ or e.__context__), seen + 1
    return None
