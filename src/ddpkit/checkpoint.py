"""Atomic checkpoints: write to a temporary name, fsync, rename; find the newest complete one on resume."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddpkit.errors import UserError, first_line

EPOCH_RE = re.compile(r"^epoch_(\d{4,})\.pt$")
TRAIN_KEYS = ("model", "epoch", "step")  # what every `ddpkit train` checkpoint holds


def _fsync_dir(path: Path) -> None:
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


def _umask() -> int:
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


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> Path:
    """write(fh) into a temporary file in path's folder, fsync, rename over path: readers never see half a file.

    A kill at any moment leaves the old file or the new one; the temporary of a killed write is swept by
    CheckpointDir.newest_complete.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; the file is the user's, as open() would make it
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """torch.save, atomically (temporary file, fsync, rename)."""
    return _atomic_write(Path(path), lambda fh: torch.save(state, fh))


def save_text(path: str | os.PathLike, text: str) -> Path:
    """Write a text file atomically (temporary file, fsync, rename)."""
    return _atomic_write(Path(path), lambda fh: fh.write(text.encode("utf-8")))


def _place(src: Path, dst: Path) -> None:
    """Make dst an atomic, independent copy of src (a copy, not a hard link: editing one must not touch the other)."""

    def copy(out: BinaryIO) -> None:
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, length=16 << 20)

    _atomic_write(dst, copy)


def load_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", require: tuple[str, ...] = ()
) -> dict[str, Any]:
    """torch.load with weights_only=True (a file from elsewhere cannot run code): whatever save_checkpoint wrote.

    UserError when the file is unreadable, or when `require` names entries it lacks (a `model` entry must be a
    state dict: names to tensors).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint '{path}' does not exist", "check checkpoint.path / checkpoint.resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, pickle with code, not a torch file at all, ...
        first = first_line(e)
        raise UserError(
            f"checkpoint '{path}' is unreadable: {first}", "point to a complete ddpkit checkpoint"
        ) from None
    if require:
        missing = [k for k in require if not isinstance(state, dict) or k not in state]
        if missing:
            raise UserError(
                f"checkpoint '{path}' holds no {', '.join(repr(k) for k in missing)} entry",
                "point to a checkpoint written by ddpkit train",
            )
        model = state.get("model")
        if "model" in require and not (
            isinstance(model, dict) and model and all(isinstance(v, torch.Tensor) for v in model.values())
        ):
            raise UserError(
                f"checkpoint '{path}' has a 'model' entry that is not a state dict of tensors",
                "point to a checkpoint written by ddpkit train",
            )
    return state


class CheckpointDir:
    """out_dir/checkpoints: last.pt, best.pt and the newest `keep` epoch_NNNN.pt files."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 3):
        self.dir = Path(out_dir) / "checkpoints"
        self.keep = keep

    @property
    def last(self) -> Path:
        return self.dir / "last.pt"

    @property
    def best(self) -> Path:
        return self.dir / "best.pt"

    def epoch_path(self, epoch: int) -> Path:
        return self.dir / f"epoch_{epoch:04d}.pt"

    def epoch_files(self) -> list[Path]:
        """Epoch checkpoints, newest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := EPOCH_RE.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save_epoch(self, state: dict[str, Any], epoch: int, is_best: bool) -> None:
        """epoch_NNNN.pt, then last.pt (and best.pt) pointing at the same bytes; prune old epoch files."""
        path = save_checkpoint(state, self.epoch_path(epoch))
        _place(path, self.last)
        if is_best:
            _place(path, self.best)
        for old in self.epoch_files()[self.keep :]:
            old.unlink(missing_ok=True)

    def save_step(self, state: dict[str, Any], is_best: bool = False) -> None:
        """A mid-epoch checkpoint: last.pt (and best.pt, when a run that ends mid-epoch scored its best)."""
        path = save_checkpoint(state, self.last)
        if is_best:
            _place(path, self.best)

    def newest_complete(self, warn=print) -> tuple[Path, dict[str, Any]] | None:
        """last.pt if it loads, else the newest epoch file that does; says which broken files it passed over."""
        if self.dir.is_dir():  # temporary files of saves that were killed half-way
            for tmp in self.dir.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
        for path in [self.last, *self.epoch_files()]:
            if not path.exists():
                continue
            try:
                return path, load_checkpoint(path, require=TRAIN_KEYS)
            except UserError as e:
                warn(f"ddpkit: warning: {e.what}; falling back to an older checkpoint")
        return None
