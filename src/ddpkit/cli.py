"""Command line: parse -> config -> start workers, or join the launcher that started us -> run the command.

User mistakes (UserError) become one `ddpkit: error: WHAT (HOW TO FIX)` line and exit 2, here and only here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ddpkit.errors import Preempted, UserError, WorkerFailure

# command -> (module:function, one-line help, takes a training config, runs on every rank of a process group).
# A command's module may also define `add_flags(parser)` (extra flags) and `preflight(cfg)` (checks that run
# before any worker starts or any file is written).
COMMANDS = {
    "train": (
        "ddpkit.trainer:train_command",
        "train a model (the default recipe: digits, built-in CNN)",
        True,
        True,
    ),
    "eval": ("ddpkit.trainer:eval_command", "score checkpoint.path on the validation set", True, True),
    "info": (
        "ddpkit.info:info_command",
        "one line per rank: rank, local_rank, world_size, host, backend, device",
        False,
        True,
    ),
    "comm": ("ddpkit.commcheck:comm_command", "check every collective and measure bandwidth", False, True),
    "slurm": (
        "ddpkit.cluster:slurm_command",
        "write (and --submit) an sbatch script that trains on N nodes x G GPUs",
        True,
        False,
    ),
    "k8s": (
        "ddpkit.cluster:k8s_command",
        "print a Kubeflow PyTorchJob manifest that trains on N pods x G GPUs",
        True,
        False,
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as a UserError (one line, exit 2) instead of usage + exit."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def _module(cmd: str):
    return importlib.import_module(COMMANDS[cmd][0].split(":")[0])


def _command_parser(cmd: str) -> argparse.ArgumentParser:
    from ddpkit.distributed.launch import add_launch_flags

    _, help_, takes_config, _ = COMMANDS[cmd]
    p = _Parser(prog=f"ddpkit {cmd}", description=help_)
    if takes_config:
        p.add_argument(
            "-c", "--config", metavar="FILE.yaml", help="YAML config; KEY=VALUE overrides win over it"
        )
        p.add_argument(
            "--help-config",
            action="store_true",
            help="print every config key with its default, type and meaning (docs/config.md), then exit",
        )
    add_flags = getattr(_module(cmd), "add_flags", None)
    if add_flags is not None:
        add_flags(p)
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. train.epochs=5"
    )
    add_launch_flags(p)
    return p


def _top_usage() -> str:
    lines = ["usage: ddpkit {train,eval,info,comm} [-c FILE.yaml] [KEY=VALUE ...] [launch flags]", ""]
    lines += [f"  {name:6s} {entry[1]}" for name, entry in COMMANDS.items()]
    lines += [
        "",
        "`ddpkit CMD --help` lists a command's flags; `ddpkit train --help-config` lists the config keys.",
    ]
    return "\n".join(lines)


def parse(argv: Sequence[str]) -> tuple[str, argparse.Namespace]:
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_usage())
        raise SystemExit(0)
    cmd = argv[0]
    if cmd not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(cmd, list(COMMANDS), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "commands: " + ", ".join(COMMANDS)
        raise UserError(f"unknown command '{cmd}'", hint)
    args = _command_parser(cmd).parse_intermixed_args(list(argv[1:]))
    return cmd, args


def _load(cmd: str, args: argparse.Namespace):
    from ddpkit.config import load_config

    if COMMANDS[cmd][2]:
        return load_config(args.config, args.overrides)
    bad = [o for o in args.overrides if not o.startswith("dist.")]
    if bad:
        raise UserError(
            f"`ddpkit {cmd}` takes only dist.* settings, got '{bad[0]}'", "e.g. dist.backend=gloo"
        )
    return load_config(None, args.overrides)


def _function(cmd: str):
    mod, fn = COMMANDS[cmd][0].split(":")
    return getattr(importlib.import_module(mod), fn)


def preflight(cmd: str, cfg, env) -> None:
    """Every check that can fail before a worker starts or a file is written."""
    from ddpkit.distributed.runtime import resolve_device_backend

    resolve_device_backend(env, cfg.dist.backend, cfg.dist.device)
    check = getattr(_module(cmd), "preflight", None)
    if check is not None:
        check(cfg)


def run(argv: Sequence[str]) -> int:
    """Run one ddpkit command line in this process (starting workers if the launch flags ask for them)."""
    from ddpkit.distributed.launch import launch_elastic, launch_spawn, spec_from_args, worker_argv

    argv = list(argv)
    cmd, args = parse(argv)
    if getattr(args, "help_config", False):
        from ddpkit.config import describe_keys

        print(describe_keys())
        return 0
    cfg = _load(cmd, args)
    if not COMMANDS[cmd][3]:  # a local command: writes or submits something, starts no process group
        return int(_function(cmd)(cfg, args) or 0)
    spec = spec_from_args(args)
    if spec.starts_workers:
        from ddpkit.distributed.env import DistEnv

        preflight(cmd, cfg, DistEnv(local_world_size=spec.nproc_per_node or 1))
        if spec.launcher == "spawn":
            launch_spawn(spec, worker_argv(argv), run)
        else:
            launch_elastic(spec, worker_argv(argv))
        return 0

    from ddpkit.distributed.env import detect_env, manual_env
    from ddpkit.distributed.runtime import init_distributed, shutdown

    env = manual_env(spec.init_method, spec.rank, spec.world_size) if spec.init_method else detect_env()
    preflight(cmd, cfg, env)
    ctx = init_distributed(cfg.dist.backend, cfg.dist.device, cfg.dist.timeout_s, env)
    try:
        return int(_function(cmd)(cfg, args, ctx) or 0)
    finally:
        shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exit 0, 2 for user errors, non-zero for failed workers."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = run(argv)
    except UserError as e:
        print(f"ddpkit: error: {e.line()}", file=sys.stderr, flush=True)
        code = e.exit_code
    except WorkerFailure as e:
        if e.exit_code != 2:  # workers that failed on a user error already said why
            print(f"ddpkit: error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            print(f"ddpkit: {e}", file=sys.stderr, flush=True)
        code = Preempted.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr, flush=True)
        code = 130
    sys.stdout.flush()
    sys.exit(code)
