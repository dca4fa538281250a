"""ddpkit: one PyTorch training script, from one process to many GPUs on many machines.

The public API: what a user's own script calls (docs/porting.md). Every name but UserError loads on first use, so
`import ddpkit` imports no torch: the command line starts its workers before it pays for torch. The framework
behind `ddpkit train` (Trainer, Config, DistEnv, the samplers) is imported from its own modules.
"""

# ruff: noqa: F401  (the TYPE_CHECKING imports are for editors: nothing here uses them)
from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit.distributed import COLLECTIVES as _COLLECTIVE_NAMES  # names only: it loads no torch
from ddpkit.errors import UserError

__version__ = "0.1.0"

# What editors and type checkers resolve each lazy name to: the table below (a test keeps the two equal).
if TYPE_CHECKING:
    from ddpkit.checkpoint import load_checkpoint, save_checkpoint
    from ddpkit.cluster.env import detect_env
    from ddpkit.data import distributed_loader, eval_loader
    from ddpkit.distributed.collectives import (
        all_gather_object,
        all_reduce_mean,
        all_reduce_sum,
        barrier,
        broadcast_object,
        gather,
        gather_object_to,
        get_rank,
        get_world_size,
        is_main_process,
        rank_zero_first,
        seed_everything,
        seed_rank,
    )
    from ddpkit.distributed.runtime import DistContext, init_distributed, shutdown
    from ddpkit.launcher.spawn import launch
    from ddpkit.models import read_weights
    from ddpkit.models.loading import load_model
    from ddpkit.parallel.clip import clip_grad_norm_
    from ddpkit.porting import prepare, unwrap
    from ddpkit.porting.state import load_state, save_state
    from ddpkit.train.optim import scaled_lr

_COLLECTIVES = "ddpkit.distributed.collectives"
_LAZY = {
    "DistContext": "ddpkit.distributed.runtime",
    "init_distributed": "ddpkit.distributed.runtime",
    "shutdown": "ddpkit.distributed.runtime",
    "detect_env": "ddpkit.cluster.env",
    **dict.fromkeys(_COLLECTIVE_NAMES, _COLLECTIVES),
    "distributed_loader": "ddpkit.data",
    "eval_loader": "ddpkit.data",
    "prepare": "ddpkit.porting",
    "unwrap": "ddpkit.porting",
    "launch": "ddpkit.launcher.spawn",
    "save_state": "ddpkit.porting.state",
    "load_state": "ddpkit.porting.state",
    "save_checkpoint": "ddpkit.checkpoint",
    "load_checkpoint": "ddpkit.checkpoint",
    "read_weights": "ddpkit.models",
    "clip_grad_norm_": "ddpkit.parallel.clip",
    "load_model": "ddpkit.models.loading",
    "scaled_lr": "ddpkit.train.optim",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


__all__ = ["UserError", *_LAZY]
