"""Atomic checkpoints: write to a temporary name, fsync, rename; find the newest complete one on resume."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddpkit.atomicio import NotRegularFile, atomic_write, check_regular, sweep_temporaries
from ddpkit.checkpoint import dcp_io, sharded
from ddpkit.checkpoint.dcp_io import read_metadata, restore_aside, surviving, tensor_entries
from ddpkit.checkpoint.fields import wrong_field
from ddpkit.checkpoint.sharded import MODEL, SIDE, is_sharded
from ddpkit.checkpoint.unreadable import unreadable_reason
from ddpkit.errors import UserError, first_line, held_warnings

EPOCH_RE = re.compile(r"^epoch_(\d{4,})\.(pt|dcp)$")
TRAIN_KEYS = ("model", "epoch", "step")  # what every `ddpkit train` checkpoint holds
CHECKPOINT_HINT = "point to a .pt file or .dcp folder written by ddpkit train"


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """torch.save, atomically (temporary file, fsync, rename)."""
    return atomic_write(Path(path), lambda fh: torch.save(state, fh))


def save_text(path: str | os.PathLike, text: str) -> Path:
    """Write a text file atomically (temporary file, fsync, rename)."""
    return atomic_write(Path(path), lambda fh: fh.write(text.encode("utf-8")))


def _place(src: Path, dst: Path) -> None:
    """Make dst an atomic, independent copy of src (a copy, not a hard link: editing one must not touch the other)."""

    def copy(out: BinaryIO) -> None:
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, length=16 << 20)

    atomic_write(dst, copy)


def _not_a_file(path: Path) -> UserError:
    try:
        check_regular(path)
    except NotRegularFile as e:
        if not path.is_dir():  # a FIFO or device would be waited on or misread; a symlink loop never opens
            return UserError(f"checkpoint '{path}' is {e.strerror}, not a checkpoint file", CHECKPOINT_HINT)
    if path.is_dir():
        names = [path / "checkpoints" / "last.pt", path / "last.pt"]
        names += [path / "checkpoints" / "last.dcp", path / "last.dcp"]
        inside = [p for p in names if p.is_file() or _is_sharded(p)]
        return UserError(
            f"checkpoint '{path}' is a folder, not a checkpoint file",
            f"did you mean '{inside[0]}'?" if inside else "point to a .pt file written by ddpkit train",
        )
    return UserError(f"checkpoint '{path}' does not exist", "check checkpoint.path / checkpoint.resume")


def _is_sharded(path: str | os.PathLike) -> bool:

    return is_sharded(path)


def check_file(path: str | os.PathLike) -> None:
    """UserError when `path` is neither a checkpoint file nor a sharded checkpoint folder: missing, or another
    folder (naming the checkpoint inside it)."""
    if not Path(path).is_file() and not _is_sharded(path):
        raise _not_a_file(Path(path))


def _not_a_state_dict(model: Any) -> str | None:
    """Why a checkpoint's `model` entry is not a state dict (names to tensors), or None when it is one."""
    if not isinstance(model, dict):
        return f"is a {type(model).__name__}, not a state dict"
    if not model:
        return "is empty"
    for k, v in model.items():
        if not isinstance(v, torch.Tensor):
            nested = " (a whole checkpoint nested inside?)" if isinstance(v, dict) else ""
            return f"maps '{first_line(str(k), 60)}' to a {type(v).__name__} value, not a tensor{nested}"
    return None


def load_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", require: tuple[str, ...] = ()
) -> dict[str, Any]:
    """torch.load with weights_only=True (a file from elsewhere cannot run code): whatever save_checkpoint wrote.

    UserError when the file is unreadable, or when `require` names entries it lacks (a `model` entry must be a
    state dict: names to tensors).
    """
    path = Path(path)
    check_file(path)
    if _is_sharded(path):
        return _load_sharded_side(path, require)
    try:
        with held_warnings():  # torch's warnings about a file refused here are not shown
            state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError as e:  # permissions, I/O errors: the file is there but cannot be read
        if e.errno == errno.EINVAL:  # torch's zip reader on a file cut short: not the disk's fault
            raise UserError(
                f"checkpoint '{path}' is unreadable: it is truncated or damaged",
                "point to a complete checkpoint written by ddpkit train",
            ) from None
        raise UserError(
            f"cannot read checkpoint '{path}': {e.strerror or e}", "check the file's permissions and disk"
        ) from None
    except Exception as e:  # truncated zip, pickle with code, not a torch file at all, ...
        raise UserError(
            f"checkpoint '{path}' is unreadable: {unreadable_reason(e)}",
            "point to a complete checkpoint written by ddpkit train",
        ) from None
    if isinstance(state, dict):
        wrong = wrong_field(state, training="epoch" in require)
        if wrong:
            raise UserError(
                f"checkpoint '{path}' is unreadable: {wrong}",
                "point to a complete checkpoint written by ddpkit train",
            )
    if require:
        missing = [k for k in require if not isinstance(state, dict) or k not in state]
        if missing:
            raise UserError(
                f"checkpoint '{path}' holds no {', '.join(repr(k) for k in missing)} entry",
                "point to a checkpoint written by ddpkit train",
            )
        why = _not_a_state_dict(state.get("model")) if "model" in require else None
        if why:
            raise UserError(
                f"checkpoint '{path}' has a 'model' entry that {why}",
                "point to a checkpoint written by ddpkit train (its 'model' is model.state_dict())",
            )
    return state


def _load_sharded_side(path: Path, require: tuple[str, ...]) -> dict[str, Any]:
    """A sharded checkpoint's state.pt (everything but the tensors), checked like a file's entries; the
    tensors' presence is read from its metadata (safely: see dcp_io)."""
    side = path / SIDE
    if not side.is_file():
        raise UserError(
            f"checkpoint '{path}' is unreadable: it has no {SIDE} (an unfinished save?)",
            "point to a complete checkpoint written by ddpkit train",
        )
    state = load_checkpoint(side, require=tuple(k for k in require if k != "model"))
    if "model" in require and not any(k.startswith(MODEL) for k in tensor_entries(read_metadata(path))):
        raise UserError(
            f"checkpoint '{path}' holds no 'model' entry", "point to a checkpoint written by ddpkit train"
        )
    return state


class CheckpointDir:
    """out_dir/checkpoints: last, best and the newest `keep` epoch_NNNN checkpoints, as .pt files
    (checkpoint.format=full) or .dcp folders (sharded); a resume reads either."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 3, sharded: bool = False):
        self.dir = Path(out_dir) / "checkpoints"
        self.keep = keep
        self.suffix = ".dcp" if sharded else ".pt"

    @property
    def last(self) -> Path:
        return self.dir / f"last{self.suffix}"

    @property
    def best(self) -> Path:
        return self.dir / f"best{self.suffix}"

    def epoch_path(self, epoch: int) -> Path:
        return self.dir / f"epoch_{epoch:04d}{self.suffix}"

    def epoch_files(self) -> list[Path]:
        """Epoch checkpoints of both formats, newest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), _mtime(p), p) for p in self.dir.iterdir() if (m := EPOCH_RE.match(p.name))]
        return [p for _, _, p in sorted(found, reverse=True)]

    def _prune(self) -> None:
        for old in self.epoch_files()[self.keep :]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def save_epoch(self, state: dict[str, Any], epoch: int, is_best: bool) -> None:
        """epoch_NNNN.pt, then last.pt (and best.pt) pointing at the same bytes; prune old epoch files."""
        path = save_checkpoint(state, self.epoch_path(epoch))
        _place(path, self.last)
        if is_best:
            _place(path, self.best)
        self._prune()

    def save_step(self, state: dict[str, Any], is_best: bool = False) -> None:
        """A mid-epoch checkpoint: last.pt (and best.pt, when a run that ends mid-epoch scored its best)."""
        path = save_checkpoint(state, self.last)
        if is_best:
            _place(path, self.best)

    def save_sharded(
        self,
        tensors: dict,
        side: dict[str, Any],
        is_main: bool,
        is_best: bool,
        background: Any = None,
        later: frozenset[str] = frozenset(),
    ) -> None:
        """The sharded counterpart of save_epoch (side["consumed"] == 0) and save_step, every rank writing its
        tensors (collective): epoch_NNNN.dcp then copies as last.dcp (and best.dcp), or last.dcp alone.
        `background` (checkpoint.background.Saves, none in flight): the state is staged (the tensors named in
        `later` by its stager's thread, until background.staged()) and written, placed, copied and pruned by its
        thread (checkpoint.async_save)."""
        target = self.last if side["consumed"] else self.epoch_path(side["epoch"])
        if background is None:
            sharded.write(target, tensors, side, is_main)
            self._placed(target, is_main, is_best)
            return
        staged, wait, place = sharded.write_in_background(
            target, tensors, side, is_main, background.group(), background.stager(), later
        )

        def finish() -> None:
            wait()
            if not background.abandoned:  # a failed run lets go of out_dir: it no longer places anything
                place()
                self._placed(target, is_main, is_best)

        background.start(finish, staged)

    def _placed(self, target: Path, is_main: bool, is_best: bool) -> None:
        """Rank 0, once `target` is in place: its copies as last.dcp (an epoch folder) and best.dcp, the old epoch
        folders pruned."""
        if not is_main:
            return
        if target != self.last:
            dcp_io.copy_folder(target, self.last)
        if is_best:
            dcp_io.copy_folder(target, self.best)
        self._prune()

    def candidates(self) -> list[Path]:
        """The checkpoints a resume may continue from, newest first: last.pt or last.dcp (the newer first), then
        the epoch checkpoints. A last.dcp that a killed save left renamed aside counts as last.dcp."""
        lasts = [p for p in (self.dir / "last.pt", surviving(self.dir / "last.dcp")) if p and p.exists()]
        return sorted(lasts, key=_mtime, reverse=True) + self.epoch_files()

    def sweep(self) -> None:
        """Remove the temporaries of saves that were killed half-way, only the names ddpkit makes (a folder
        renamed aside goes back)."""
        if self.dir.is_dir() and not self.dir.is_symlink():
            for old in self.dir.glob(".*.dcp.prev"):
                restore_aside(self.dir / old.name[1 : -len(".prev")])
        sweep_temporaries(self.dir)

    def newest_complete(self, warn=print) -> tuple[Path, dict[str, Any]] | None:
        """last.pt if it loads, else the newest epoch file that does; says which broken files it passed over
        (reading only: temporaries of killed saves are left to sweep())."""
        for path in self.candidates():
            try:
                return path, load_checkpoint(path, require=TRAIN_KEYS)
            except UserError as e:
                warn(f"ddpkit: warning: {e.what}; falling back to an older checkpoint")
        return None


def _mtime(path: Path) -> float:
    """When a checkpoint was completed: its file's time, or a folder's state.pt's (written last)."""
    try:
        return (path / SIDE if path.is_dir() else path).stat().st_mtime
    except OSError:
        return 0.0
