"""Workers that start with torch already imported: torch's elastic agent forks them from a fork server.

Without it a launch pays for torch twice in a row: the launcher imports it to run the elastic agent, then each
worker it starts imports it again. Here the launcher starts multiprocessing's fork server first, before it
imports torch itself; the server imports torch and the command's modules while the launcher imports torch
and runs the rendezvous, on another core, and the agent then gets each worker as a fork of the server
(`start_method="forkserver"`, the function entry point of torch's elastic launcher). A worker then makes
itself what `python -u -m ddpkit ARGV` started by the agent would be: the same environment (the launcher's,
plus what the agent sets for each rank), the same sys.argv, unbuffered output, the signals given back, an
uncaught exception printed with exit status 1, and atexit handlers run at the end. It also dies with the fork
server (which dies with the launcher), as a worker started as a program dies with the launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable
from multiprocessing import forkserver
from typing import Any

from ddpkit import channels
from ddpkit.diagnostics import stacks
from ddpkit.launcher import signals

# What every worker of a launch imports, whatever its command; a command module's preload(cfg) adds its own
# (cli.py has the fork server import them before the workers start: each worker is a fork that has them).
EVERY_WORKER = ["torch", "ddpkit.cli", "torch.distributed.elastic.multiprocessing.api"]
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
SOURCE_BYTES = 1 << 20
DISABLE_VAR = channels.WARM_START  # "0": workers start as fresh interpreters (python -u -m ddpkit ...)
SERVER = "ddpkit.launcher.warm_server"
_started = False
_exits: str | None = None  # the folder the fork server writes each worker's exit status into


def ends_without_finalization() -> bool:
    """Whether this process ends with os._exit (a forked worker): no interpreter finalization, so nothing of
    gloo's can be caught in it (runtime._drain_at_exit need not wait)."""
    return channels.FLAGS.forked_worker


def available() -> bool:
    """Whether workers can be forked from a fork server here (not on Windows, not when the user said 0)."""
    return os.environ.get(DISABLE_VAR, "1") != "0" and "forkserver" in multiprocessing.get_all_start_methods()


def main_is_ddpkit() -> bool:
    """Whether this program is `python -m ddpkit` or the `ddpkit` script: a forked worker imports the
    program's main module again (as multiprocessing does), which must not run anything; a user's script that
    calls ddpkit.cli.main() itself may not be guarded by `if __name__ == "__main__"`."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return name == "ddpkit.__main__"
    return os.path.basename(getattr(main, "__file__", "") or "") == "ddpkit"


def sets_thread_variable(target: list[str]) -> bool:
    """Whether the script (`[SCRIPT, ...]` or `[-m, MODULE, ...]`) names a variable that torch, its OpenMP or
    numpy's BLAS read only while they are imported: a script that sets one before `import torch` gets it only
    in a fresh interpreter (a fork of the server has torch imported already), so its workers start as programs.
    Read from the script's text (at most SOURCE_BYTES of it)."""
    path: str | None = target[0] if target and target[0] != "-m" else None
    if path is None and len(target) > 1:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # where `python -m` looks first
        with contextlib.suppress(Exception):  # not found: the check before the launch said so
            path = getattr(importlib.util.find_spec(target[1]), "origin", None)
        sys.path.pop(0)
    if not path:
        return False
    try:
        with open(path, "rb") as fh:
            text = fh.read(SOURCE_BYTES)
    except OSError:
        return False
    return any(name.encode() in text for name in THREAD_VARIABLES)


def start(modules: Iterable[str]) -> bool:
    """Start the fork server importing `modules` in the background (call before importing torch); False
    when warm starts are not available."""
    global _started
    if not available():
        return False
    global _exits
    forkserver.set_forkserver_preload([SERVER, *modules])
    _exits = tempfile.mkdtemp(prefix="ddpkit-exits-")
    # the server dies with us; `python -u`; it writes each worker's exit status into _exits
    with signals.launcher_env(), _environ(PYTHONUNBUFFERED="1", **{channels.WORKER_EXITS: _exits}):
        forkserver.ensure_running()
    _started = True
    return True


def worker_exits() -> dict[int, int]:
    """{pid: exit status (negative: the signal)} of every worker the fork server has reaped so far."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_exits or ""):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(_exits, name)) as fh:
                out[int(name)] = int(fh.read(32))
    return out


def running() -> bool:
    """Whether start() started the fork server in this process."""
    return _started


def stop() -> None:
    """End the fork server now (the launch failed before any worker started): it holds our stdout open."""
    global _started, _exits
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if _started and pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        forkserver._forkserver._stop()
    if _exits:
        shutil.rmtree(_exits, ignore_errors=True)
    _started, _exits = False, None


class LaunchEnviron:
    """The launcher's environment, taken when the agent starts a worker (as the agent copies it for a
    worker it starts as a program)."""

    def __reduce__(self):
        return dict, (dict(os.environ),)


class LaunchStdin:
    """The launcher's standard input, handed to a worker the agent forks from the fork server (a worker it
    starts as a program inherits it, as under torchrun; multiprocessing gives a fork /dev/null instead). Pickled
    while the agent starts the worker, it travels as a file descriptor (multiprocessing's DupFd)."""

    def __reduce__(self):
        from multiprocessing import reduction

        stream = sys.__stdin__  # None when the launcher started without one (fd 0 may since be another file)
        try:
            fd = stream.fileno()
            os.fstat(fd)
        except (AttributeError, OSError, ValueError):  # none, or closed: the worker gets /dev/null
            return _Stdin, (None, None, None)
        return _Stdin, (reduction.DupFd(fd), stream.encoding, stream.errors)


class _Stdin:
    """In the worker: the launcher's standard input, received (fd), made this process's fd 0 and sys.stdin."""

    def __init__(self, dup: Any, encoding: str | None, errors: str | None):
        self.fd = None if dup is None else dup.detach()
        self.encoding, self.errors = encoding, errors

    def install(self) -> None:
        if self.fd is None:
            return
        os.dup2(self.fd, 0)
        os.close(self.fd)
        sys.stdin = sys.__stdin__ = open(0, encoding=self.encoding, errors=self.errors, closefd=False)  # noqa: SIM115


def exit_steps() -> None:
    """What a normal exit does before the interpreter's finalization, for a process that ends with os._exit:
    atexit handlers run, standard streams flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def worker(fn: Callable[[list[str]], Any], argv: list[str], environ: dict[str, str], stdin: _Stdin) -> None:
    """In a forked worker: become `python -u -m ddpkit ARGV` as the agent would have started it, run fn(argv)."""
    warm_server = sys.modules[SERVER]  # the fork server imported it first (its preload); never imported here

    # Its own session, as torch's agent starts a worker program (and torchrun each worker): the scheduler's
    # autogroups then share the CPU per worker, not one share for all the launcher's forks under load.
    with contextlib.suppress(OSError):
        os.setsid()
    channels.FLAGS.forked_worker = True
    stdin.install()
    agent = {k: v for k, v in os.environ.items() if warm_server.BASE_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**environ, **agent})
    os.environ.pop(signals.PARENT_VAR, None)  # not the launcher's child: it dies with the server
    os.environ.pop(channels.WORKER_EXITS, None)
    os.waitpid = warm_server.WAITPID  # the server's recording one is the server's
    if not (os.environ.get("PYTHONFAULTHANDLER") or "faulthandler" in sys._xoptions):
        faulthandler.disable()  # torch's function entry point enabled it; a program starts without it
    signals.die_with_parent(warm_server.SERVER_PID)
    sys.argv = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "__main__.py"), *argv]
    if not sys.flags.safe_path:
        sys.path[0] = os.getcwd()  # what `python -m` puts first
    signal.pthread_sigmask(signal.SIG_UNBLOCK, warm_server.HELD)
    # A fork of the fork server has multiprocessing's start method set to "forkserver": the worker's own
    # processes (a DataLoader's workers) would start from a new fork server of their own, each importing torch
    # again, and hand every batch over through it. A worker started as a program has none set yet.
    multiprocessing.set_start_method(None, force=True)
    code: Any = 0
    try:
        fn(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_steps()  # the worker ends with os._exit
    stacks.mark_ended()  # but only once every worker of this node is done (torch's function entry point)
    if code:
        raise SystemExit(code)


@contextlib.contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
