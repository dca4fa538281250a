"""ddpkit: one PyTorch training script, from one process to many GPUs on many machines.

The public API. Every name but UserError loads on first use, so `import ddpkit` imports no torch: the command
line starts its workers before it pays for torch.
"""

from ddpkit import _moved
from ddpkit.distributed import COLLECTIVES as _COLLECTIVES  # names only: it loads no torch
from ddpkit.errors import UserError

_moved.install()  # modules that moved into the subsystem folders stay importable under their old names

__version__ = "0.1.0"

_LAZY = {
    "DistContext": "ddpkit.distributed.runtime",
    "init_distributed": "ddpkit.distributed.runtime",
    "shutdown": "ddpkit.distributed.runtime",
    "DistEnv": "ddpkit.cluster.env",
    "detect_env": "ddpkit.cluster.env",
    **dict.fromkeys(_COLLECTIVES, "ddpkit.distributed.collectives"),
    "Config": "ddpkit.config",
    "load_config": "ddpkit.config",
    "Trainer": "ddpkit.train.trainer",
    "DistributedLoader": "ddpkit.data",
    "distributed_loader": "ddpkit.data",
    "GlobalOrderSampler": "ddpkit.data",
    "ExactEvalSampler": "ddpkit.data",
    "evaluate": "ddpkit.train.trainer",
    "eval_loader": "ddpkit.data",
    "prepare": "ddpkit.porting",
    "unwrap": "ddpkit.porting",
    "launch": "ddpkit.launcher.spawn",
    "save_state": "ddpkit.porting.state",
    "load_state": "ddpkit.porting.state",
    "save_checkpoint": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "read_weights": "ddpkit.models",
    "scaled_lr": "ddpkit.train.optim",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


__all__ = ["UserError", *_LAZY]
