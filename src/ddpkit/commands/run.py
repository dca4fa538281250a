"""`ddpkit run [launch flags] SCRIPT.py [args]` / `ddpkit run [launch flags] -m MODULE [args]`: a user's own
script, unchanged, as torchrun would run it — under every launcher.

- With launch flags that start workers (--nproc-per-node, --nnodes, ...) torch's elastic agent starts them with
  torchrun's variables (or torch.multiprocessing.spawn with --launcher spawn runs the script in each worker).
  SIGTERM, SIGUSR1 and SIGINT to this launcher go on to the workers, it exits with their status, and they die
  with it.
- Without them, this process is one rank of whatever started it (srun, mpirun, torchrun, the Kubeflow operator,
  or nothing: one process): ddpkit sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR
  and MASTER_PORT from the launcher's own variables and replaces itself with `python -u SCRIPT` (exec), so the
  script's output, signals and exit code are its own.
In every case the script runs as `__main__` through launcher/usermain.py, which lets a gloo job end cleanly.
Everything after SCRIPT (or -m MODULE) belongs to the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ddpkit.atomicio import NotRegularFile, check_regular
from ddpkit.cluster.env import detect_env, torch_variables
from ddpkit.commands import CommandParser
from ddpkit.distributed import local_rank
from ddpkit.distributed.torchrun_compat import NO_VALUE
from ddpkit.errors import Preempted, UserError, WorkerFailure
from ddpkit.launcher import usermain, warm_start
from ddpkit.launcher.elastic import launch_elastic
from ddpkit.launcher.launch import free_port, launch_spawn, start_warm
from ddpkit.launcher.spec import LAUNCH_FLAGS, add_launch_flags, spec_from_args
from ddpkit.launcher.usermain import run_spawned, warm_script
from ddpkit.launcher.usermodule import check_module

# What a script's worker has imported when it is forked (launcher/warm_start.py): torch, and what runs the
# script; nothing of ddpkit's that the script would not import itself.
SCRIPT_WORKER = ["torch", "torch.distributed.elastic.multiprocessing.api", "ddpkit.launcher.usermain"]

USAGE = (
    "ddpkit run [launch flags] SCRIPT.py [script args ...]  |  ddpkit run [launch flags] -m MODULE [args ...]"
)


def _parser() -> argparse.ArgumentParser:

    p = CommandParser(
        prog="ddpkit run",
        usage=USAGE,
        description="Run your own training script as torchrun would, under any launcher; it gets RANK, "
        "LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT.",
    )
    add_launch_flags(p)
    local_rank.add_flag(p)
    return p


def split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(ddpkit's launch flags, the python arguments: [SCRIPT, args...] or [-m, MODULE, args...])."""
    flags = LAUNCH_FLAGS | local_rank.FLAGS
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            i += 1
        elif a == "-m":
            if i + 1 >= len(argv):
                raise UserError("ddpkit run -m needs a module name", USAGE)
            return argv[:i], argv[i:]
        elif a in NO_VALUE:
            i += 1
        elif a.split("=", 1)[0] in flags:
            i += 1 if "=" in a else 2
        elif a.startswith("-"):
            raise UserError(f"ddpkit run: unknown flag '{a}' before the script", f"usage: {USAGE}")
        else:
            return argv[:i], argv[i:]
    return argv, []


def _check_target(target: list[str]) -> None:
    if not target:
        raise UserError("ddpkit run needs a script to run", f"usage: {USAGE}")
    if target[0] == "-m":
        check_module(target[1])
    else:
        script = target[0]
        if not os.path.exists(script):
            raise UserError(f"script '{script}' does not exist", "check the path (relative to this folder)")
        if os.path.isdir(script):
            raise UserError(f"script '{script}' is a folder", "give a .py file, or -m PACKAGE.MODULE")
        try:
            check_regular(script)
        except NotRegularFile as e:  # a FIFO would block every worker reading it
            raise UserError(f"script '{script}' is {e.strerror}, not a file", "give a .py file") from None


def _exec(target: list[str]) -> None:
    """Become `python -u TARGET` with torchrun's variables for this rank (never returns)."""
    env = detect_env()
    variables = torch_variables(env)
    if env.launcher == "none":  # one process, as `torchrun --nproc-per-node 1` would run it
        variables["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(free_port())
    os.environ.update(variables)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", "-m", usermain.__name__, *target])


def run_command(argv: Sequence[str]) -> int:
    """`ddpkit run`: parse, then start workers or become the script."""
    flags, target = split(argv)
    args = _parser().parse_args(flags)
    spec = spec_from_args(args)
    if spec.init_method is not None:
        raise UserError(
            "ddpkit run does not take --init-method: a script reads MASTER_ADDR/MASTER_PORT",
            "start each rank with MASTER_ADDR=HOST MASTER_PORT=PORT RANK=R WORLD_SIZE=W ddpkit run SCRIPT",
        )
    _check_target(target)
    local_rank.arrange(args.pass_local_rank, target)
    if not spec.starts_workers:
        _exec(target)
    warm = start_warm(spec, SCRIPT_WORKER, script=target)
    import torch

    from ddpkit.distributed.runtime import check_cpu_processes

    try:
        if not torch.cuda.is_available():
            check_cpu_processes(spec.nproc_per_node or 1)
        if spec.launcher == "spawn":
            launch_spawn(spec, target, run_spawned, script=True)
        else:
            launch_elastic(spec, ["-u", *target], warm=(warm_script, target) if warm else None, script=True)
    except Preempted as e:
        if e.signum is not None:  # this launcher was signalled: the script's workers were stopped
            return 128 + e.signum
        return Preempted.exit_code
    except WorkerFailure as e:  # exit 2: a UserError ddpkit raised inside the script, said once for the job
        prefix = "ddpkit: error: " if e.exit_code == UserError.exit_code else "ddpkit: "
        print(f"{prefix}{e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        warm_start.stop()
    return 0
