"""A user's own script as `__main__` of a ddpkit worker: `python -u -m ddpkit.launcher.usermain SCRIPT.py ARGS`
(or `-m MODULE ARGS`) runs it as `python SCRIPT.py ARGS` would, with two differences that only show at exit.

- The script runs inside this process (runpy), so when it returns, the objects it made (a DDP model that still
  holds its process group, the group's gloo threads) are released while the interpreter is fully alive. Under
  a plain `python SCRIPT.py` they are released during interpreter finalization, where a gloo worker thread that
  asks for the GIL is ended by Python and the process aborts ("terminate called without an active exception",
  SIGABRT) after a run that succeeded: the rank, and so the whole job, is reported failed.
- Then, as ddpkit's own workers do, it waits a moment with the GIL free for gloo's threads to drop finished
  work (runtime.EXIT_DRAIN_S).

Before that, a worker the launcher started itself arranges to die with the launcher (signals.die_with_launcher).
The script's exit status is the process's: its SystemExit code, 2 after a ddpkit refusal it did not catch (one
`ddpkit: error:` line, said once for the job by the launcher), 1 after any other uncaught exception (with the
traceback from the script's own frames, as Python prints it), or death by the signal that ended it.
"""

from __future__ import annotations

import builtins
import gc
import importlib.machinery
import io
import os
import pkgutil
import runpy
import sys
import time
import types

from ddpkit.diagnostics import stacks
from ddpkit.distributed import group_check
from ddpkit.distributed.local_rank import script_args
from ddpkit.errors import UserError
from ddpkit.launcher import warm_start
from ddpkit.launcher.signals import die_with_launcher


def run_python(target: list[str]) -> int:
    """Run `python TARGET` inside this process: the script (or -m MODULE) as __main__; its exit status.
    An uncaught exception propagates (a spawned worker reports it to its launcher)."""
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *script_args(target[2:])]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target[0], *script_args(target[1:])]
            _run_file(target[0])
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _run_file(typed: str) -> None:
    """`python TYPED` in this process, as python itself sets it up: `__main__` with an absolute `__file__`,
    sys.argv[0] as typed, the script's real folder (symlinks resolved) first on sys.path, so a script reached
    through a symlink imports the modules beside its real file. (runpy.run_path makes sys.argv[0] absolute.)"""
    path = os.path.abspath(typed)
    if pkgutil.get_importer(path) is not None:  # a zip file with a __main__.py: runpy's way
        runpy.run_path(path, run_name="__main__")
        return
    if not sys.flags.safe_path:
        sys.path.insert(0, os.path.dirname(os.path.realpath(typed)))
    with io.open_code(path) as fh:
        code = pkgutil.read_code(fh)  # a compiled .pyc, as python runs one
    if code is None:
        with io.open_code(path) as fh:
            code = compile(fh.read(), path, "exec")
    main = types.ModuleType("__main__")
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __loader__=loader, __cached__=None, __builtins__=builtins)
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _script_frames(tb):
    """The traceback from the first frame outside this module and runpy: what `python SCRIPT.py` shows."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    return tb


def run_released(target: list[str]) -> int:
    """run_python, then release what the script made while the interpreter is alive, and let gloo drain."""
    try:
        code = run_python(target)
        group_check.warn_if_no_group()
        return code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        gc.collect()  # the script's objects in reference cycles (its functions' globals) go now, too
        # no gloo threads without torch.distributed (and no torch import to pay for); a forked worker ends with
        # os._exit, without the interpreter's finalization that the wait is for
        if "torch.distributed" in sys.modules and not warm_start.ends_without_finalization():
            from ddpkit.distributed.runtime import EXIT_DRAIN_S

            time.sleep(EXIT_DRAIN_S)


def _report(e: BaseException) -> int:
    """The script's traceback as `python SCRIPT.py` prints it, through sys.excepthook: once the script made a
    process group, torch's hook prefixes each line with `[rankN]:` (as under torchrun). A UserError that ddpkit
    raised in the script (prepare, launch, the loaders) is ddpkit's one line instead, said once for the job by
    the launcher; the exit status: 2 for it, else 1."""
    if isinstance(e, UserError):
        line = f"ddpkit: error: {e.line()}"
        if not stacks.say_error(line):
            print(line, file=sys.stderr, flush=True)
        return e.exit_code
    tb = _script_frames(e.__traceback__)
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    sys.stderr.flush()
    return 1


def run_spawned(target: list[str]) -> int:
    """The script in a worker that torch.multiprocessing.spawn started: the platform's own start method for the
    script's processes (a DataLoader's workers must not inherit spawn's), its traceback printed here."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    try:
        return run_released(target)
    except Exception as e:
        return _report(e)


def main(argv: list[str]) -> int:

    die_with_launcher()
    stacks.arm()  # SIGUSR2 dumps the script's Python stack (for the launcher's straggler watch)
    if argv[:1] == ["-u"]:  # already unbuffered: this process was started with -u
        argv = argv[1:]
    if argv[:1] != ["-m"] and sys.path[:1] in ([""], [os.getcwd()]):
        sys.path.pop(
            0
        )  # `python -m` put the working folder first; `python SCRIPT.py` has the script's folder
    try:
        return run_released(argv)
    except Exception as e:
        return _report(e)


def warm_script(target: list[str]) -> None:
    """main() in a worker forked from the launcher's fork server (warm_start.worker runs it): its status is the
    process's."""
    sys.exit(main(target))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
