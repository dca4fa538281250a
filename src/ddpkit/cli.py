"""Command line: parse -> config -> start workers, or join the launcher that started us -> run the command.

User mistakes (UserError) become one `ddpkit: error: WHAT (HOW TO FIX)` line and exit 2, failures (Failure) their
own line and exit code, an OSError (a full or read-only disk, ...) one line naming the path and exit 1, here and
only here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from ddpkit.cluster.env import DistEnv, detect_env, manual_env
from ddpkit.commands import COMMANDS, Command, CommandParser, all_commands, get_command
from ddpkit.config import describe_keys, load_config
from ddpkit.diagnostics import stacks
from ddpkit.distributed import allocator
from ddpkit.errors import CollectiveFailure, Failure, UserError, describe_os_error, escaped, printed
from ddpkit.launcher import startup, warm_start
from ddpkit.launcher.elastic import launch_elastic
from ddpkit.launcher.launch import launch_spawn, start_warm
from ddpkit.launcher.signals import die_with_launcher
from ddpkit.launcher.spec import LAUNCH_FLAGS, add_launch_flags, spec_from_args, worker_argv
from ddpkit.launcher.warm_start import exit_steps, main_is_ddpkit
from ddpkit.parallel.mesh import layout_of
from ddpkit.parallel.plan import check_config


def command_parser(command: Command) -> argparse.ArgumentParser:
    """The parser of `ddpkit CMD`: its config arguments, its own flags, and launch flags where they apply."""
    p = CommandParser(prog=f"ddpkit {command.name}", description=command.help)
    if command.config == "train":
        p.add_argument(
            "-c", "--config", metavar="FILE.yaml", help="YAML config; KEY=VALUE overrides win over it"
        )
        p.add_argument(
            "--help-config",
            action="store_true",
            help="print every config key with its default, type and meaning (docs/config.md), then exit",
        )
    flags = command.hook("flags")
    if flags is not None:
        flags(p)
    if command.config != "none":
        what = (
            "dotted config overrides, e.g. train.epochs=5" if command.config == "train" else "dist.* settings"
        )
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=what)
    if command.mode == "group":
        add_launch_flags(p)
    return p


def top_usage() -> str:
    """`ddpkit --help`: every command with its one-line help."""
    commands = all_commands()
    lines = ["usage: ddpkit {" + ",".join(commands) + "} ...", ""]
    lines += [f"  {c.name:6s} {c.help}" for c in commands.values()]
    lines += [
        "",
        "`ddpkit CMD --help` lists a command's flags; `ddpkit train --help-config` lists the config keys.",
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str]) -> tuple[Command, argparse.Namespace]:
    """(the command, its parsed arguments); UserError for an unknown command or a bad flag."""
    if not argv or argv[0] in ("-h", "--help"):
        print(top_usage())
        raise SystemExit(0)
    name = argv[0]
    command = get_command(name)
    if command is None:
        names = list(all_commands())
        raise UserError(
            f"unknown command '{name}'", COMMANDS.hint(name, names, otherwise="commands: " + ", ".join(names))
        )
    if command.mode != "group":
        given = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in LAUNCH_FLAGS]
        if given:
            raise UserError(
                f"launch flags do not apply to `ddpkit {name}` ({given[0]})",
                f"`ddpkit {name} --help` lists its flags; launch flags belong to "
                + ", ".join(c.name for c in all_commands().values() if c.takes_launch_flags),
            )
    return command, command_parser(command).parse_intermixed_args(list(argv[1:]))


def _load(command: Command, args: argparse.Namespace):

    if command.config == "none":
        return None
    if command.config == "train":
        return load_config(args.config, args.overrides)
    bad = [o for o in args.overrides if not o.startswith("dist.")]
    if bad:
        raise UserError(
            f"`ddpkit {command.name}` takes only dist.* settings, got '{bad[0]}'", "e.g. dist.backend=gloo"
        )
    return load_config(None, args.overrides)


def preflight(command: Command, cfg, env) -> None:
    """Every check that can fail before a worker starts or a file is written."""
    from ddpkit.distributed.runtime import resolve_device_backend

    backend, _ = resolve_device_backend(env, cfg.dist.backend, cfg.dist.device)

    if command.plans_layout:  # the model can be split over these ranks, the strategy can run over them
        check_config(cfg, env.world_size, env.local_world_size, backend)
    else:
        layout_of(env.world_size, cfg.dist.tp, cfg.dist.pp)
    check = command.hook("preflight")
    if check is not None:
        check(cfg)


def run(argv: Sequence[str]) -> int:
    """Run one ddpkit command line in this process (starting workers if the launch flags ask for them)."""
    argv = list(argv)
    allocator.profile()  # a DDPKIT_MALLOC_TUNE that is none of its settings: refused before anything starts
    script = get_command(argv[0]) if argv and not argv[0].startswith("-") else None
    if script is not None and script.mode == "script":
        return int(script.function(argv[1:]) or 0)
    command, args = parse(argv)
    if getattr(args, "help_config", False):
        print(describe_keys())
        return 0
    cfg = _load(command, args)
    if command.mode == "local":  # writes or submits something, starts no process group
        return int(command.function(cfg, args) or 0)
    return _run_group(command, cfg, args, argv)


def _run_group(command: Command, cfg, args: argparse.Namespace, argv: list[str]) -> int:

    spec = spec_from_args(args)
    if spec.starts_workers:
        startup.publish()  # the workers measure their start-up from ours
        preload = command.hook("preload")
        if preload is not None:
            start_warm(
                spec, preload(cfg)
            )  # it imports torch for the workers while we import it for the agent
        in_launcher = command.hook("in_launcher")
        tail = in_launcher(cfg, spec) if in_launcher is not None else None
        try:
            nproc = spec.nproc_per_node or 1
            preflight(command, cfg, DistEnv(local_world_size=nproc, world_size=nproc * spec.nnodes))
            meanwhile = tail.start if tail is not None else None
            with tail if tail is not None else contextlib.nullcontext():
                if spec.launcher == "spawn":
                    launch_spawn(spec, worker_argv(argv), run, meanwhile)
                else:
                    python_args = ["-u", "-m", "ddpkit", *worker_argv(argv)]
                    launch_elastic(spec, python_args, warm=(main, worker_argv(argv)), meanwhile=meanwhile)
        finally:
            warm_start.stop()
        path = tail.draw() if tail is not None else None
        if path is not None:
            print(f"curves: {path}", flush=True)
        return 0

    from ddpkit.distributed.runtime import init_distributed, shutdown

    env = (
        manual_env(spec.init_method, spec.rank, spec.world_size, spec.local_rank)
        if spec.init_method
        else detect_env()
    )
    preflight(command, cfg, env)
    startup.mark("imported")
    ctx = init_distributed(cfg.dist.backend, cfg.dist.device, cfg.dist.timeout_s, env)
    startup.mark("rendezvous")
    try:
        return int(command.function(cfg, args, ctx) or 0)
    finally:
        shutdown()


def _stdout_gone() -> bool:
    """This process's stdout is a pipe whose reader closed it (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exit 0, 2 for user errors, the failure's own code (1, or 3 when preempted), 1 for an
    OSError."""
    die_with_launcher()  # a worker that ddpkit's launcher started as a program ends with it
    stacks.arm()  # SIGUSR2 dumps this process's Python stack
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = run(argv)
    except UserError as e:
        if not stacks.say_error(f"ddpkit: error: {e.line()}"):  # a worker's: its launcher says it once
            print(printed("ddpkit: error: ", e), file=sys.stderr, flush=True)
        code = e.exit_code
    except Failure as e:
        line = f"{e.prefix}{escaped(str(e))}"
        # a rank that gave up on a collective under ddpkit's launcher: its launcher names the cause instead
        left = isinstance(e, CollectiveFailure) and stacks.say_error(line, kind="comm")
        if e.report and not left:  # one line for the job: the raiser decided whether this process says it
            print(line, file=sys.stderr, flush=True)
        code = e.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr, flush=True)
        code = 130
    except OSError as e:  # a disk that filled up or went read-only, a path that is not a folder, ...
        code = 0
        if not (isinstance(e, BrokenPipeError) and _stdout_gone()):  # `ddpkit k8s | head -1`: not an error
            what, hint = describe_os_error(e)
            print(f"ddpkit: error: {escaped(what)} ({hint})", file=sys.stderr, flush=True)
            code = 1
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the reader of our stdout went away: nothing left to say to it
        from ddpkit.train.metrics import silence_stdout

        silence_stdout()
    if _finished_launcher():
        _exit_without_finalization(code)
    sys.exit(code)


def _finished_launcher() -> bool:
    """This process is the `ddpkit` program (not a library caller of main()) and it started workers."""
    launch = sys.modules.get("ddpkit.launcher.launch")
    if launch is None or not launch.launched():
        return False

    return main_is_ddpkit()


def _exit_without_finalization(code: int) -> NoReturn:
    """End a launcher whose workers have finished as a normal exit would (non-daemon threads joined, atexit
    handlers run, streams flushed), but without the interpreter's finalization: with torch loaded it takes
    about 0.5 s (module teardown, C++ static destructors) that the job's command would wait for, and a launcher
    has nothing left for it to do."""
    import os
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    exit_steps()
    os._exit(code)
