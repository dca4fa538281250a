"""Atomic file writes without torch: write a temporary file beside the target, fsync, rename over it.

Checkpoints (checkpoint/, through torch.save) and the report's pictures and tables (commands/report.py, which must not
pay for a torch import) are written this way: a reader, or a run killed mid-write, never sees half a file.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
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


# The temporary names atomic_write makes (mkstemp: `.NAME.` + 8 of [a-z0-9_] + `.tmp`): only these are swept.
TEMP_RE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")


class NotOwnFile(OSError):
    """A path where ddpkit writes its own file holds a symlink, a folder or another non-regular file."""


def _refused(path: str | os.PathLike, what: str) -> NotOwnFile:
    return NotOwnFile(errno.EEXIST, what, str(path))


def open_own(path: str | os.PathLike, flags: int, mode: int = 0o666, dir_fd: int | None = None) -> int:
    """os.open for a file ddpkit writes itself: never through a symlink (O_NOFOLLOW), never a FIFO, device or
    folder, never a file with other hard links (writing it would change another name's bytes). NotOwnFile
    otherwise; the check and the open are one system call, so nothing can swap the file in between."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(path, "a symlink where ddpkit keeps its own file") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):
            raise _refused(path, "not a regular file where ddpkit keeps its own file") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file where ddpkit keeps its own file"
    elif st.st_nlink > 1 and flags & (os.O_WRONLY | os.O_RDWR):
        problem = "a file with other hard links where ddpkit keeps its own file"
    if problem:
        os.close(fd)
        raise _refused(path, problem)
    os.set_blocking(fd, True)
    return fd


class NotRegularFile(OSError):
    """A path where ddpkit reads or writes a file holds a FIFO, a device, a socket or a folder."""


def kind_of(mode: int) -> str:
    """'a FIFO', 'a folder', ... for a file's st_mode."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str | os.PathLike) -> os.stat_result | None:
    """os.stat(path) when it is a regular file, None when nothing is there; NotRegularFile (naming the kind)
    for a FIFO, device, socket, folder or symlink loop, which opening would block on or misread. Use open_regular where
    ddpkit opens the file itself (no window between the check and the open)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink loop", str(path)) from None
        raise
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, kind_of(st.st_mode), str(path))
    return st


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """os.open that never blocks on a FIFO or device: opened with O_NONBLOCK, checked with fstat, then made
    blocking. NotRegularFile (naming the kind) when `path` is not a regular file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no reader opened for writing; a folder
            st = os.stat(path)
            raise NotRegularFile(errno.EINVAL, kind_of(st.st_mode), str(path)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, kind_of(st.st_mode), str(path))
    os.set_blocking(fd, True)
    return fd


def _open_folder(folder: str | os.PathLike) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing, or a symlink: a symlinked folder holds none of ours
        return None


def _temporaries(fd: int) -> list[str]:
    names = []
    for name in os.listdir(fd):
        if TEMP_RE.match(name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):  # a file, or a folder (mkdtemp)
                names.append(name)
    return names


def sweep_temporaries(folder: str | os.PathLike) -> int:
    """Delete the leftover temporaries of killed saves in `folder`: regular files and folders with the names
    mkstemp/mkdtemp make for ddpkit (`.NAME.XXXXXXXX.tmp`), never any other file, nothing in a symlinked
    folder; how many went."""
    fd = _open_folder(folder)
    if fd is None:
        return 0
    gone = 0
    try:
        for name in _temporaries(fd):
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)  # never follows a symlink inside
                else:
                    os.unlink(name, dir_fd=fd)
                gone += 1
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return gone
