"""One run per out_dir: what an earlier run left there and what to do with it (continue it, refuse, or move it
aside), decided by the process that holds out_dir's lock (runlock.py) before the first byte is written.

A restart or requeue of the job that wrote the earlier run (the lock file names its job) carries on with it,
whatever checkpoint.resume and checkpoint.overwrite say: they chose how the job began, not how it goes on.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ddpkit.atomicio import TEMP_RE
from ddpkit.checkpoint import TRAIN_KEYS, CheckpointDir, check_file, load_checkpoint, save_text
from ddpkit.distributed.collectives import all_gather_object, broadcast_object
from ddpkit.errors import Failure, UserError, describe_os_error
from ddpkit.train.metrics import read_metrics
from ddpkit.train.runlock import LOCK_NAME, RunLock, check_free, read_holder, same_job

PREVIOUS = "previous"  # out_dir/previous/DATE-TIME/: earlier runs moved aside by checkpoint.overwrite=true
RUN_FILES = ("config.yaml", "log.txt", "metrics.jsonl", "checkpoints", "tensorboard", "curves.png")
T = TypeVar("T")

# ------------------------------------------------------------------------------------------- agreement


def _raise_agreed(err: tuple[str, str | None] | None, is_main: bool) -> None:
    """Raise the UserError every rank agreed on: rank 0 says it, the others exit 2 quietly (one line per job)."""
    if err is None:
        return
    if is_main:
        raise UserError(*err)
    raise Failure(UserError(*err).line(), exit_code=UserError.exit_code, report=False)


def decided_by_main(fn: Callable[[], T], is_main: bool) -> T:
    """Rank 0 runs fn (collective): every rank gets its result, or raises the UserError it raised."""
    result, err = None, None
    if is_main:
        try:
            result = fn()
        except UserError as e:
            err = (e.what, e.hint)
        except OSError as e:  # the other ranks wait for the answer: they must hear of this one too
            err = describe_os_error(e)
    result, err = broadcast_object((result, err))
    _raise_agreed(err, is_main)
    return result  # type: ignore[return-value]


def checked_on_every_rank(fn: Callable[[], T], is_main: bool) -> T:
    """Every rank runs fn (collective); a UserError on any rank (the lowest one's) is raised on every rank."""
    result, err = None, None
    try:
        result = fn()
    except UserError as e:
        err = (e.what, e.hint)
    _raise_agreed(next((e for e in all_gather_object(err) if e), None), is_main)
    return result  # type: ignore[return-value]


# --------------------------------------------------------------------------------------- the out_dir


def _unwritable(out: Path, path: Path) -> UserError:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return UserError(
            f"out_dir '{out}' is on a read-only file system ('{path}')",
            "choose an out_dir on a writable disk",
        )
    return UserError(
        f"out_dir '{out}' is not writable: no write permission on '{path}'",
        "give this user write access to it, or choose another out_dir",
    )


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """UserError when out_dir cannot hold this run: a file, under a file, or not writable. Reads only."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"out_dir '{out}' exists and is not a folder", "choose another out_dir")
    existing = out.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(
            f"out_dir '{out}' cannot be made: '{existing}' is a file, not a folder", "choose another out_dir"
        )
    ckpts = out / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():
        raise UserError(f"'{ckpts}' is not a folder", "move it away, or choose another out_dir")
    check_own_files(out)
    for path in [existing, ckpts, out / "log.txt", out / "metrics.jsonl"]:
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise _unwritable(out, path)


OWN_FILES = (LOCK_NAME, "config.yaml", "log.txt", "metrics.jsonl", "curves.png")
OWN_FOLDERS = ("checkpoints", "tensorboard", PREVIOUS)


def _kind(path: Path) -> str | None:
    """'a symlink', 'a folder', 'not a regular file' or None (a regular file, or nothing)."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a folder"
    return None if stat.S_ISREG(mode) else "not a regular file"


def _links(path: Path) -> int:
    try:
        return path.lstat().st_nlink
    except OSError:
        return 0


def check_own_files(out: Path) -> None:
    """UserError when a name where ddpkit writes its own file or folder in out_dir holds a symlink or something
    of the wrong kind: ddpkit would write through it into a file that is not its own. Reads only."""
    own = [(out / n, None) for n in OWN_FILES] + [(out / n, "a folder") for n in OWN_FOLDERS]
    ckpts = out / "checkpoints"
    if _kind(ckpts) == "a folder":
        # a checkpoint is a file, or a folder (checkpoint.format=sharded, .dcp): never a symlink
        ours = (".pt", ".dcp", ".dcp.prev")
        own += [(p, "either") for p in ckpts.iterdir() if p.name.endswith(ours) or TEMP_RE.match(p.name)]
    for path, want in own:
        kind = _kind(path)
        if (
            kind is None and want is None and _links(path) > 1
        ):  # appending to it would change another name's bytes
            kind = "a file with other hard links"
        if kind is not None and kind != want and not (want == "either" and kind == "a folder"):
            raise UserError(
                f"'{path}' is {kind}, where ddpkit keeps its own {'folder' if want == 'a folder' else 'file'}",
                "move it away (ddpkit never writes through symlinks), or choose another out_dir",
            )


@dataclass(frozen=True)
class Earlier:
    """What an earlier run left in out_dir: its files, checkpoint files and the epochs in metrics.jsonl."""

    out: Path
    files: tuple[str, ...]
    checkpoints: tuple[str, ...]
    epochs: tuple[int, ...]

    @property
    def has_run(self) -> bool:
        """Checkpoints or metrics: something a new run must not overwrite or append to."""
        return bool(self.checkpoints or self.epochs)

    def describe(self) -> str:
        parts = []
        if self.epochs:
            e = self.epochs
            parts.append(
                f"epoch{'s' if len(e) > 1 else ''} {e[0]}{f'-{e[-1]}' if len(e) > 1 else ''} in metrics.jsonl"
            )
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint file(s)")
        return ", ".join(parts)


def inspect(out_dir: str | os.PathLike) -> Earlier:
    """What out_dir holds of an earlier run (reads only)."""
    out = Path(out_dir)
    files = tuple(n for n in RUN_FILES if (out / n).exists())
    ckpt_dir = out / "checkpoints"
    found = [*ckpt_dir.glob("*.pt"), *ckpt_dir.glob("*.dcp")] if ckpt_dir.is_dir() else []
    ckpts = tuple(sorted(p.name for p in found))
    epochs = tuple(int(r["epoch"]) for r in read_metrics(out) if isinstance(r.get("epoch"), int))
    return Earlier(out, files, ckpts, epochs)


CONTINUE_OR_AFRESH = "resume=auto continues, checkpoint.overwrite=true starts anew"


def _fresh_hint(out: Path) -> str:
    return f"checkpoint.overwrite=true starts afresh (the run moves to {out / PREVIOUS}/), or use another out_dir"


def newest_readable(out: Path, earlier: Earlier, warn: Callable[[str], None]) -> tuple[str, dict]:
    """(path, state) of the newest checkpoint a run continues from; UserError listing them when none loads."""
    broken: list[str] = []
    why: dict[str, list[str]] = {}  # reason -> file names: the refusal names out_dir once, each reason once
    for path in CheckpointDir(out).candidates():
        try:
            state = load_checkpoint(path, require=TRAIN_KEYS)
        except UserError as e:
            broken.append(e.what)
            reason = e.what.replace(f"checkpoint '{path}' ", "", 1).removeprefix("is ")
            why.setdefault(reason, []).append(path.name)
            continue
        for what in broken:
            warn(f"ddpkit: warning: {what}; falling back to an older checkpoint")
        return str(path), state
    if broken:
        shown = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in why.items())
        raise UserError(
            f"no checkpoint of the run in out_dir '{out}' can be continued: {shown}",
            "move them aside, or " + _fresh_hint(out),
        )
    raise UserError(
        f"out_dir '{out}' holds an earlier run ({earlier.describe()}) but no checkpoint to continue it from",
        _fresh_hint(out),
    )


@dataclass(frozen=True)
class Plan:
    """What this run does with out_dir: the checkpoint it starts from (None: afresh), whether the earlier run
    is moved aside first."""

    source: str | None = None
    move_aside: bool = False


def decide(cfg, earlier: Earlier, same_job: bool, warn: Callable[[str], None] | None) -> Plan | None:
    """Continue, start afresh, move aside or refuse (UserError); `warn=None` (the launcher) reads no checkpoint
    and returns None where the answer needs one."""
    resume, overwrite, out = cfg.checkpoint.resume, cfg.checkpoint.overwrite, earlier.out
    path = None if resume in ("auto", "none") else resume
    if path is not None:
        check_file(path)
    if same_job and earlier.checkpoints:  # a restart or requeue of the job that wrote them: carry on
        return Plan(newest_readable(out, earlier, warn)[0]) if warn else None
    if overwrite:
        return Plan(path, move_aside=bool(earlier.files))
    if "config.yaml" in earlier.files and "log.txt" not in earlier.files:  # ddpkit writes both at once
        raise UserError(
            f"out_dir '{out}' holds a config.yaml that no ddpkit run wrote (no log.txt beside it): it would "
            "be replaced",
            "choose another out_dir (e.g. runs/NAME), or move the file away",
        )
    if not earlier.has_run:
        return Plan(path)
    if resume == "none":
        raise UserError(
            f"out_dir '{out}' holds an earlier run ({earlier.describe()}): checkpoint.resume=none would start "
            "over",
            CONTINUE_OR_AFRESH,
        )
    if warn is None:
        return None
    newest, state = newest_readable(out, earlier, warn)
    if path is None:
        return Plan(newest)
    given = load_checkpoint(path, require=TRAIN_KEYS)
    progress = ("epoch", "step", "consumed")
    if [given.get(k) for k in progress] == [state.get(k) for k in progress]:
        return Plan(path)
    raise UserError(
        f"checkpoint.resume '{path}' is behind out_dir '{out}' (step {state['step']}): it would "
        "replace that run's later checkpoints and metrics",
        CONTINUE_OR_AFRESH,
    )


def move_aside(out_dir: str | os.PathLike, names: tuple[str, ...]) -> Path:
    """Move an earlier run's files into out_dir/previous/DATE-TIME/ (renames: nothing copied or deleted)."""
    out = Path(out_dir)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    dest, n = out / PREVIOUS / stamp, 1
    while dest.exists():
        n += 1
        dest = out / PREVIOUS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in names:
        os.rename(out / name, dest / name)
    return dest


def preflight(cfg) -> None:
    """The checks of out_dir that need no checkpoint read and write nothing (the launcher, before workers)."""
    check_out_dir(cfg.out_dir)
    check_free(cfg.out_dir)
    out = Path(cfg.out_dir)
    if out.is_dir():
        decide(cfg, inspect(out), same_job(read_holder(out)), warn=None)
    elif cfg.checkpoint.resume not in ("auto", "none"):
        check_file(cfg.checkpoint.resume)


class RunDir:
    """A run's hold on out_dir: open() checks, decides and begins, close() lets go (a run that never began
    leaves out_dir as it found it). Rank 0 holds the lock and writes; the other ranks take part in the
    collectives only."""

    def __init__(self, cfg, is_main: bool, log):
        self.cfg, self.is_main, self.log = cfg, is_main, log
        self.out = Path(cfg.out_dir)
        self.lock = RunLock(self.out)
        self.plan = Plan()
        self.began = False
        self._made: list[Path] = []

    def open(self, config_text: str, check: Callable[[str | None], T]) -> tuple[str | None, T]:
        """Collective: rank 0 checks out_dir, locks it and decides what the run continues from (a checkpoint's
        path, None: afresh); every rank runs check(path); only when every rank passed, rank 0 moves an earlier
        run aside if asked, writes config.yaml and opens log.txt. A UserError anywhere is raised on every rank."""
        source = decided_by_main(self._claim, self.is_main)
        checked = checked_on_every_rank(lambda: check(source), self.is_main)
        self.begin(config_text)
        return source, checked

    def _claim(self) -> str | None:
        try:
            check_out_dir(self.out)
            self._make_dirs()
            same = same_job(self.lock.acquire())
            self.plan = decide(self.cfg, inspect(self.out), same, self.log.info) or Plan()
            return self.plan.source
        except BaseException:
            self.close()
            raise

    def _make_dirs(self) -> None:
        missing = []
        for path in [self.out, *self.out.parents]:
            if path.exists():
                break
            missing.append(path)
        self.out.mkdir(parents=True, exist_ok=True)
        self._made = missing  # deepest first: removed in this order if the run never begins

    def begin(self, config_text: str) -> None:
        """Rank 0, after every check passed: move the earlier run aside if asked, write config.yaml, open log.txt."""
        if not self.is_main:
            return
        self.began = True
        if self.plan.move_aside:
            dest = move_aside(self.out, inspect(self.out).files)
            self.log.info(f"checkpoint.overwrite=true: the earlier run in {self.out} was moved to {dest}")
        CheckpointDir(self.out).sweep()
        save_text(self.out / "config.yaml", config_text)
        self.log.open()

    def close(self) -> None:
        """Let go of out_dir; a run that never began leaves it as it found it."""
        self.lock.release(undo=not self.began)
        if not self.began:
            for path in self._made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            self._made = []
