"""No silent hang: every ddpkit worker dumps its Python stack on SIGUSR2, and the launcher watches for ranks
left running after others ended (stragglers), and says each worker's user error once for the job.

- A worker (`ddpkit train`, `ddpkit run`'s script, `--launcher spawn`) calls arm(): faulthandler dumps every
  thread's stack on SIGUSR2 (SIGTERM and SIGUSR1 stop a run for preemption, SIGUSR2 is free). A worker of
  ddpkit's own launcher writes the dump into the job folder the launcher made (rankN.stack, beside rankN.pid);
  any other process writes it to stderr.
- The launcher (Watch, while its workers run): when some ranks have ended and others still run after
  `--straggler-timeout S` (default 300), it prints which ranks still run and their stacks, prefixed
  `[rankN]:`, once, and keeps waiting, or with `--straggler-action stop` ends them (SIGKILL). SIGUSR2 to the
  launcher prints every running rank's stack at once; `ddpkit stacks [PID]` does the same from another shell.
- A user error that workers find (a damaged checkpoint every rank loads) is written to rankN.error instead of
  stderr; the launcher prints it once for the job. A Python warning every rank gives is printed once for the
  job (diagnostics.warn_once, claimed in the same folder).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from ddpkit import channels
from ddpkit.atomicio import open_regular
from ddpkit.diagnostics import warn_once
from ddpkit.errors import Failure, UserError, WorkerFailure

SIGNAL = signal.SIGUSR2
DEFAULT_TIMEOUT_S = 300.0
ACTIONS = ("report", "stop")
FLAGS = frozenset({"--straggler-timeout", "--straggler-action"})
JOB_PREFIX = "ddpkit-job-"
_RANK_FILE = re.compile(r"^rank(\d+)\.pid$")
LAUNCHER_FILE = "launcher.pid"  # `PID IDENTITY` of the launcher that made a job folder
_ARMED: dict[
    str, object
] = {}  # this worker's job folder, rank and open stack file (kept open for faulthandler)


def add_flags(group) -> None:
    """--straggler-timeout and --straggler-action on the launch flags' argparse group."""
    group.add_argument(
        "--straggler-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="when some ranks ended and others still run after S seconds, name them and print their stacks "
        f"(default {DEFAULT_TIMEOUT_S:.0f})",
    )
    group.add_argument(
        "--straggler-action",
        choices=ACTIONS,
        default="report",
        help="after naming the ranks still running: keep waiting (report, default) or end them (stop)",
    )


def check_timeout(seconds: float) -> None:
    if not seconds > 0 or seconds == float("inf"):
        raise UserError(
            f"--straggler-timeout must be > 0 seconds, got {seconds}", "use e.g. --straggler-timeout 300"
        )


# ------------------------------------------------------------------------------------------------ workers


def arm() -> None:
    """In a worker (or any ddpkit process): SIGUSR2 dumps every thread's Python stack, into the launcher's job
    folder when it made one for this rank, else to stderr. Takes the folder out of the environment, so that
    processes the worker starts are not taken for ranks."""
    job, rank = os.environ.pop(channels.JOB_DIR, None), os.environ.get("RANK", "")
    out: TextIO = sys.stderr
    if job and rank.isdigit() and os.path.isdir(job):
        try:
            fd = os.open(
                os.path.join(job, f"rank{rank}.stack"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
            )
            out = os.fdopen(fd, "w")
            Path(job, f"rank{rank}.pid").write_text(f"{os.getpid()} {identity(os.getpid())}")
            Path(job, f"rank{rank}.ended").unlink(missing_ok=True)  # this rank's worker of an earlier round
            _ARMED.update(job=job, rank=rank, file=out)

            warn_once.install(job)  # a warning every rank gives is printed once for the job
        except OSError:
            out = sys.stderr
    with contextlib.suppress(ValueError, OSError, AttributeError, RuntimeError):  # no usable stderr: no dump
        faulthandler.register(SIGNAL, file=out, all_threads=True)


def mark_ended() -> None:
    """In a worker whose process outlives its work: a fork of the warm fork server (torch's elastic function
    entry point) waits there until every worker of its node is done. The launcher's straggler watch counts
    this rank as ended from now on, as it would a worker process that exited."""
    job, rank = _ARMED.get("job"), _ARMED.get("rank")
    if job:
        with contextlib.suppress(OSError):
            Path(str(job), f"rank{rank}.ended").touch()


def say_error(line: str, kind: str = "error") -> bool:
    """In a worker of ddpkit's launcher: leave the error line for the launcher to print once for the job
    (True); elsewhere False (the caller prints it). `kind` "comm": this rank gave up on a collective, the
    launcher names the cause instead."""
    job, rank = _ARMED.get("job"), _ARMED.get("rank")
    if not job:
        return False
    try:
        tmp = Path(str(job), f".rank{rank}.{kind}")
        tmp.write_text(line, encoding="utf-8")
        os.replace(tmp, Path(str(job), f"rank{rank}.{kind}"))
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------ the launcher


def running(pid: int) -> bool:
    """Process `pid` exists and is not a zombie (an ended worker its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def identity(pid: int) -> str | None:
    """What tells process `pid` from a later process given the same pid: its start time (clock ticks since boot,
    /proc/PID/stat field 22) and a digest of its command line; None when it is gone."""
    import hashlib

    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return f"{int(stat[19])}-{hashlib.sha256(cmdline).hexdigest()[:16]}"
    except (OSError, ValueError, IndexError):
        return None


def _record(path: Path) -> tuple[int, str] | None:
    """(pid, identity) from a `PID IDENTITY` file ddpkit wrote; None for anything else."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            pid, ident = fh.read(200).decode("ascii").split()
        return int(pid), ident
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def proven(path: Path) -> int | None:
    """The pid recorded in `path` when that process still runs and is the one that wrote it (same start time
    and command line: a pid the system gave to another process since is not it); None otherwise."""
    found = _record(path)
    if found is None or not running(found[0]) or identity(found[0]) != found[1]:
        return None
    return found[0]


def registered(job: Path) -> dict[int, int]:
    """{rank: pid} of the workers that armed themselves in job folder `job` (running or not)."""
    ranks = {}
    with contextlib.suppress(OSError):
        for p in job.iterdir():
            m = _RANK_FILE.match(p.name)
            found = _record(p) if m else None
            if found:
                ranks[int(m.group(1))] = found[0]
    return ranks


def stopped_while_ending(pid: int) -> bool:
    """Process `pid` is stopped (SIGSTOP, Ctrl-Z; not a debugger's trace stop) with a SIGTERM waiting: it was
    asked to end (torch's agent ends a failed job's workers with SIGTERM, then SIGKILL 30 s later) and can act
    on it only once it is continued."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
        state = fields["State"].split()[0]
    except (KeyError, ValueError, IndexError):
        return False
    return state == "T" and bool(pending >> (signal.SIGTERM - 1) & 1)


def live(job: Path) -> dict[int, int]:
    """{rank: pid} of the workers of job folder `job` that still run, each proven to be that worker (only
    these are ever signalled)."""
    return {
        r: pid
        for r in registered(job)
        if not (job / f"rank{r}.ended").exists() and (pid := proven(job / f"rank{r}.pid")) is not None
    }


def launcher_alive(job: Path) -> bool:
    """The launcher that made job folder `job` still runs (proven by the LAUNCHER_FILE it wrote)."""
    return proven(job / LAUNCHER_FILE) is not None


def collect_stacks(job: Path, ranks: dict[int, int], wait_s: float = 3.0) -> dict[int, str]:
    """SIGUSR2 to each rank's pid, then each one's new dump from its stack file ({rank: text}; empty when it
    wrote nothing within `wait_s`)."""
    start = {}
    for rank, pid in ranks.items():
        path = job / f"rank{rank}.stack"
        start[rank] = path.stat().st_size if path.exists() else 0
        with contextlib.suppress(OSError):
            os.kill(pid, SIGNAL)
    deadline, sizes = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = {r: (job / f"rank{r}.stack").stat().st_size for r in ranks if (job / f"rank{r}.stack").exists()}
        if now == sizes and all(now.get(r, 0) > start[r] for r in ranks):
            break  # every rank wrote, and nothing grew since the last look
        sizes = now
    texts = {}
    for rank in ranks:
        with contextlib.suppress(OSError), open(job / f"rank{rank}.stack", "rb") as fh:
            fh.seek(start[rank])
            texts[rank] = fh.read(1 << 20).decode("utf-8", errors="replace")
    return texts


def prefixed(stacks: dict[int, str]) -> str:
    """Each rank's dump, every line prefixed `[rankN]: `."""
    lines = []
    for rank in sorted(stacks):
        body = stacks[rank].rstrip("\n").splitlines() or [
            "(no stack written: the process did not answer SIGUSR2)"
        ]
        lines += [f"[rank{rank}]: {ln}" for ln in body]
    return "\n".join(lines)


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks))


def sweep_stale_jobs(tmp: str | None = None) -> list[Path]:
    """Remove the job folders of launchers that are gone (a launcher ended by SIGKILL cannot remove its own):
    only this user's, only where the launcher that wrote the folder's LAUNCHER_FILE no longer runs (a process
    that got its pid since is not it). Returns them."""
    gone = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{JOB_PREFIX}*-*"):
        pid = path.name[len(JOB_PREFIX) :].split("-", 1)[0]
        with contextlib.suppress(OSError):
            if (
                pid.isdigit()
                and path.is_dir()
                and not path.is_symlink()
                and path.stat().st_uid == os.getuid()
                and not launcher_alive(path)  # a folder without the file yet: its launcher's pid is gone
                and ((path / LAUNCHER_FILE).exists() or not running(int(pid)))
            ):
                shutil.rmtree(path, ignore_errors=True)
                gone.append(path)
    return gone


class Watch:
    """The launcher's side while its workers run (a context manager around the wait): the job folder in the
    workers' environment, the straggler watch thread, SIGUSR2 -> every rank's stack. `errors`: the distinct
    error lines its workers left, lowest rank first; `gave_up`: {rank: line} of the ranks that gave up on a
    collective; `pids`: {rank: pid} of the workers (all read when the wait ends)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, action: str = "report", say: Callable = print):
        self.timeout_s, self.action, self._say = timeout_s, action, say
        sweep_stale_jobs()
        self.job = Path(tempfile.mkdtemp(prefix=f"{JOB_PREFIX}{os.getpid()}-"))
        (self.job / LAUNCHER_FILE).write_text(f"{os.getpid()} {identity(os.getpid())}")
        self.errors: list[str] = []
        self.gave_up: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.stopped: list[int] = []
        self._done, self._now = threading.Event(), threading.Event()
        self._old_env: str | None = None
        self._old_handler = None
        self._thread = threading.Thread(target=self._loop, name="ddpkit-straggler-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._old_env = os.environ.get(channels.JOB_DIR)
        os.environ[channels.JOB_DIR] = str(self.job)
        with contextlib.suppress(ValueError):  # not the main thread: `ddpkit stacks` still works
            self._old_handler = signal.signal(SIGNAL, lambda *_: self._now.set())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        if self._old_handler is not None:
            signal.signal(SIGNAL, self._old_handler)
        if self._old_env is None:
            os.environ.pop(channels.JOB_DIR, None)
        else:
            os.environ[channels.JOB_DIR] = self._old_env
        self.read_errors()
        shutil.rmtree(self.job, ignore_errors=True)

    def read_errors(self) -> list[str]:
        """The distinct error lines the workers left so far, lowest rank first (kept in `errors`; also the
        lines of ranks that gave up on a collective, in `gave_up`, and the workers' pids)."""
        self.pids.update(registered(self.job))
        for kind in ("error", "comm"):
            for path in sorted(
                self.job.glob(f"rank*.{kind}"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)
            ):
                with contextlib.suppress(OSError):
                    line = path.read_text(encoding="utf-8", errors="replace").strip()
                    if (
                        kind == "comm" and line
                    ):  # the worker left its whole line; the launcher adds its own prefix
                        self.gave_up[int(re.sub(r"\D", "", path.name))] = line.removeprefix(Failure.prefix)
                    elif line and line not in self.errors:
                        self.errors.append(line)
        return self.errors

    def _print(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._say(text, file=sys.stderr, flush=True)

    def _loop(self) -> None:
        first_end: float | None = None
        reported = False
        while not self._done.wait(0.5):
            ranks = registered(self.job)
            alive = live(self.job)
            for pid in alive.values():
                if stopped_while_ending(pid):  # act on the SIGTERM now, not after the agent's 30 s grace
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
            ended = sorted(set(ranks) - set(alive))
            if self._now.is_set():
                self._now.clear()
                self._print(
                    f"ddpkit: stacks of {_names(alive)} (SIGUSR2)\n{prefixed(collect_stacks(self.job, alive))}"
                )
            if not (ended and alive):
                first_end = None
                continue
            first_end = first_end or time.monotonic()
            if reported or time.monotonic() - first_end < self.timeout_s:
                continue
            reported = True
            self._straggle(alive, ended)

    def _straggle(self, alive: dict[int, int], ended: list[int]) -> None:
        stop = self.action == "stop"
        then = (
            "ending them (--straggler-action stop)"
            if stop
            else "still waiting (--straggler-action stop ends them)"
        )
        stacks = prefixed(collect_stacks(self.job, alive))
        self._print(
            f"ddpkit: {_names(alive)} still running {self.timeout_s:g} s after {_names(ended)} ended; "
            f"{then}; their Python stacks:\n{stacks}"
        )
        if stop:
            self.stopped = sorted(alive)
            for pid in alive.values():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def job_failure(err: Failure, watch: Watch) -> Failure:
    """How a launch whose workers failed ends: the workers' user error, said once for the job (exit 2), or
    `err` naming the ranks that --straggler-action stop ended."""
    errors = watch.read_errors()
    if err.exit_code == 2 and errors:
        first = errors[0].removeprefix(Failure.prefix)
        more = f" (and {len(errors) - 1} other error(s) on other ranks)" if len(errors) > 1 else ""
        return WorkerFailure(first + more, exit_code=2)
    if watch.stopped:
        return WorkerFailure(
            f"{_names(watch.stopped)} ended by --straggler-action stop ({watch.timeout_s:g} s after others "
            f"ended): {err}",
            exit_code=err.exit_code,
        )
    return err
