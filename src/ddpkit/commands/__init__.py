"""The command registry: one small `Command` per `ddpkit CMD`; adding a command is one module and one entry in
`BUILTIN`, or, from another package, `register_command` or an entry point in the `ddpkit.commands` group.

What the command line asks of a command besides its function is a field of its entry, each a "module:function"
loaded when it is needed (`Command.hook`): its own flags, its checks before any worker starts, the modules its
workers import, what its launcher does meanwhile.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from ddpkit.errors import UserError
from ddpkit.registry import Registry


class CommandParser(argparse.ArgumentParser):
    """argparse that reports mistakes as a UserError (one line, exit 2) instead of usage + exit."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


@dataclass(frozen=True)
class Command:
    """One `ddpkit CMD`.

    config: which KEY=VALUE settings it takes (`train`: the whole config and -c FILE; `dist`: dist.* only;
    `none`: none). mode: `group` runs on every rank of a process group (launch flags apply) and is called as
    fn(cfg, args, ctx); `local` runs here, once, as fn(cfg, args); `script` parses its own command line, fn(argv).
    The hooks ("module:function", None: it has none):
    `flags(parser)`: adds its own flags;
    `preflight(cfg)`: checks that run before any worker starts or any file is written;
    `preload(cfg) -> [modules]`: what every worker of a launch imports (the launch's fork server imports them once);
    `in_launcher(cfg, spec) -> tail | None`: what the launcher of a one-node launch does for the run (a context
    manager with `start()`, called once the workers are launched, and `draw()`, after they succeeded).
    `plans_layout`: its whole config's layout is checked before workers start (parallel/plan.py: the strategy
    over the data-parallel ranks, the model split as asked); otherwise only the dist.tp x dist.pp grid.
    """

    name: str
    help: str
    entry: str  # "module:function"
    config: Literal["train", "dist", "none"] = "train"
    mode: Literal["group", "local", "script"] = "group"
    flags: str | None = None
    preflight: str | None = None
    preload: str | None = None
    in_launcher: str | None = None
    plans_layout: bool = False

    @property
    def takes_launch_flags(self) -> bool:
        """A group command runs on the workers the launch flags start; `script` (run) starts the user's."""
        return self.mode in ("group", "script")

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(self.entry.split(":")[0])

    @property
    def function(self) -> Any:
        return self.hook("entry")

    def hook(self, field: str) -> Any:
        """The function a hook field (or `entry`) names, loaded now; None when the command has none."""
        ref = getattr(self, field)
        if ref is None:
            return None
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)


_T = "ddpkit.commands.train:"
BUILTIN = (
    Command(
        "train",
        "train a model (the default recipe: digits, built-in CNN)",
        _T + "train_command",
        preflight=_T + "preflight",
        preload=_T + "preload",
        in_launcher=_T + "in_launcher",
        plans_layout=True,
    ),
    Command(
        "eval",
        "score checkpoint.path on the validation set",
        "ddpkit.commands.eval:eval_command",
        preload="ddpkit.commands.eval:preload",
    ),
    Command(
        "run",
        "run your own script (torchrun-style) unchanged under any launcher: ddpkit run [flags] SCRIPT.py",
        "ddpkit.commands.run:run_command",
        config="none",
        mode="script",
    ),
    Command(
        "generate",
        "sample text from a trained language model: ddpkit generate RUN_DIR_OR_CHECKPOINT --prompt TEXT",
        "ddpkit.commands.lm.generate:generate_command",
        config="none",
        mode="script",
    ),
    Command(
        "export",
        "write a trained GPT as a Hugging Face folder: ddpkit export CHECKPOINT --to hf OUT_DIR",
        "ddpkit.commands.lm.export:export_command",
        config="none",
        mode="script",
    ),
    Command(
        "stacks",
        "print the Python stack of every rank of a running ddpkit job: ddpkit stacks [LAUNCHER_PID]",
        "ddpkit.commands.stacks:stacks_command",
        config="none",
        mode="script",
    ),
    Command(
        "info",
        "one line per rank: rank, local_rank, world_size, host, backend, device",
        "ddpkit.commands.info:info_command",
        config="dist",
        preload="ddpkit.commands.info:preload",
    ),
    Command(
        "comm",
        "check every collective and measure bandwidth",
        "ddpkit.commands.comm:comm_command",
        config="dist",
        flags="ddpkit.commands.comm:add_flags",
        preload="ddpkit.commands.comm:preload",
    ),
    Command(
        "report",
        "compare runs: curves (PNG), a table of accuracy, time and throughput, --html, --json",
        "ddpkit.commands.report:report_command",
        config="none",
        mode="local",
        flags="ddpkit.commands.report:add_flags",
    ),
    Command(
        "bench",
        "scaling: images/s, speed-up and efficiency of the same training at each --nproc count",
        "ddpkit.commands.bench:bench_command",
        mode="local",
        flags="ddpkit.commands.bench:add_flags",
    ),
    Command(
        "slurm",
        "write (and --submit) an sbatch script that trains on N nodes x G GPUs",
        "ddpkit.commands.slurm:slurm_command",
        mode="local",
        flags="ddpkit.commands.slurm:add_flags",
    ),
    Command(
        "k8s",
        "print a Kubeflow PyTorchJob manifest that trains on N pods x G GPUs",
        "ddpkit.commands.k8s:k8s_command",
        mode="local",
        flags="ddpkit.commands.k8s:add_flags",
    ),
)

ENTRY_POINT_GROUP = "ddpkit.commands"
COMMANDS: Registry[Command] = Registry(
    "command", ENTRY_POINT_GROUP, Command, "ddpkit.commands.Command", builtins=lambda: BUILTIN
)


def register_command(command: Command, *, replace: bool = False) -> Command:
    """Make `ddpkit NAME` run `command`. Refuses a second command of the same name unless replace=True."""
    return COMMANDS.register(command, replace=replace)


def get_command(name: str) -> Command | None:
    """The command `ddpkit NAME` runs (the built-ins first; an installed package's asked only then), or None."""
    return COMMANDS.find(name)


def all_commands() -> dict[str, Command]:
    """Every command: the built-ins and those installed packages declare (for `ddpkit --help` and hints)."""
    return {c.name: c for c in COMMANDS.entries()}
