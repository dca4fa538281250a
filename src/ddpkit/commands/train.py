"""`ddpkit train`: the Trainer on every rank, after the checks that can fail before anything is written."""

from __future__ import annotations

from ddpkit.config import Config
from ddpkit.distributed.health import Heartbeat, explain_comm_failures
from ddpkit.distributed.runtime import DistContext


def check_inputs(cfg: Config) -> None:
    """The data, the model and checkpoint.resume, checked without reading them (train and eval)."""
    from ddpkit import data, models
    from ddpkit.checkpoint import check_file

    data.check_available(cfg)
    models.check_arch(cfg)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_file(cfg.checkpoint.resume)


def preflight(cfg: Config) -> None:
    """Checks that run before any worker starts or any file is written: the inputs, then out_dir (a folder we
    may write, held by no live run, and holding no earlier run that this one would overwrite)."""
    from ddpkit import rundir

    check_inputs(cfg)
    rundir.preflight(cfg)


def train_command(cfg: Config, args, ctx: DistContext) -> int:
    """`ddpkit train`."""
    from ddpkit.trainer import Trainer

    with Heartbeat(ctx.rank, ctx.world_size) as heartbeat:
        with explain_comm_failures(ctx, heartbeat, lambda: 0):  # set-up collectives (DDP's broadcast, ...)
            trainer = Trainer(cfg, ctx, heartbeat)
        trainer.fit()
    return 0
