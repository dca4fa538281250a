"""Modules that moved into the subsystem folders, importable under their old names for one release; and
`names()`, the lazy `__getattr__` of a module whose names load from elsewhere.

An old name is an alias of the module itself, not a copy: `import ddpkit.trainer` gives the very module object
`ddpkit.train.trainer` (so a test's or a user's monkeypatch of the old name patches the code that runs). The
table is the whole mechanism: no file is left at an old path. Importing an old name warns (DeprecationWarning,
pointing at the import statement). Installed by `ddpkit/__init__.py`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

_D, _L, _T = "ddpkit.distributed.", "ddpkit.launcher.", "ddpkit.train."

MOVED: dict[str, str] = {
    **{
        _D + m: _L + m
        for m in ("launch", "spawn", "warm_start", "warm_server", "usermain", "signals", "peers")
    },
    _D + "env": "ddpkit.cluster.env",
    _D + "netif": "ddpkit.cluster.netif",
    _D + "sync_bn": "ddpkit.parallel.sync_bn",
    _D + "collective_check": "ddpkit.diagnostics.collective_check",
    _D + "collective_bench": "ddpkit.diagnostics.collective_bench",
    _D + "stop": _T + "stop",
    _D + "health": _T + "health",
    **{
        "ddpkit." + m: _T + m
        for m in ("trainer", "builders", "optim", "train_state", "rundir", "runlock", "metrics")
    },
    "ddpkit.startup": "ddpkit.launcher.startup",
    "ddpkit.rng": "ddpkit.porting.rng",
    _D + "stacks": "ddpkit.diagnostics.stacks",
    "ddpkit.data.roles": "ddpkit.porting.roles",
    "ddpkit.parallel.state_dict": "ddpkit.checkpoint.state_dict",
    _D + "strategy": "ddpkit.parallel.strategy",
    _D + "compression": "ddpkit.parallel.compression",
    "ddpkit.checkpoint_fields": "ddpkit.checkpoint.fields",
    "ddpkit.usermodule": "ddpkit.launcher.usermodule",
    "ddpkit.metrics_file": _T + "metrics_file",
    "ddpkit.outputs": "ddpkit.commands.outputs",
    "ddpkit.commands.report.drawing": _T + "curves.drawing",
    "ddpkit.memory": _T + "memory",
    "ddpkit.tasks": _T + "tasks",
    "ddpkit.sharded": "ddpkit.checkpoint.sharded",
    "ddpkit.dcp_io": "ddpkit.checkpoint.dcp_io",
    "ddpkit.state": "ddpkit.porting.state",
    "ddpkit.report": "ddpkit.commands.report",
    "ddpkit.bench": "ddpkit.commands.bench",
    "ddpkit.cluster.slurm": "ddpkit.commands.slurm",
    "ddpkit.cluster.k8s": "ddpkit.commands.k8s",
    "ddpkit.cluster.common": "ddpkit.commands.jobs",
    "ddpkit.config_schema": "ddpkit.config.schema",
    "ddpkit.config_yaml": "ddpkit.config.safe_yaml",
    "ddpkit.bounded": "ddpkit.config.bounded",
    "ddpkit.gpt": "ddpkit.models.gpt",
    **{
        "ddpkit.parallel." + old: "ddpkit.parallel.pipeline." + new
        for old, new in (
            ("pipeline_api", "user_model"),
            ("pipeline_plan", "plan"),
            ("pipeline_split", "split"),
            ("stage_state", "stage_state"),
        )
    },
    "ddpkit.parallel.pipeline_trainer": _T + "steps.pipeline",
    "ddpkit.parallel.pipeline.trainer": _T + "steps.pipeline",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module at its new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,  # warnings skips the import machinery's frames: the import statement
        )
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the old name's spec on the module: give it back its own
        module.__spec__ = module.__spec__.loader_state


def names(owner: str, where: dict[str, str]):
    """A module's `__getattr__` (PEP 562) for names that live in other modules: {name: module it loads from}."""

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {owner!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
