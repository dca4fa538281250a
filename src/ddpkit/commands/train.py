"""`ddpkit train`: the Trainer on every rank, after the checks that can fail before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.config import Config
from ddpkit.errors import UserError

if TYPE_CHECKING:  # torch loads when the command runs, not when its flags are parsed
    from ddpkit.distributed.runtime import DistContext


def preflight(cfg: Config) -> None:
    """Checks that run before any worker starts or any file is written."""
    from ddpkit import data, models

    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"out_dir '{out}' exists and is not a folder", "choose another out_dir")
    data.check_available(cfg)
    models.check_arch(cfg)
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).is_file():
        raise UserError(
            f"checkpoint.resume '{cfg.checkpoint.resume}' does not exist",
            "use auto, none or a checkpoint file",
        )


def preload(cfg: Config) -> list[str]:
    """The modules every worker imports: a launch imports them once, before the workers start."""
    # torch._dynamo too: torch's optimizers import it at their first step (it takes about as long as torch)
    modules = ["torch", "ddpkit.cli", "ddpkit.trainer", "torch._dynamo", "torch.utils.tensorboard"]
    modules += ["torch.distributed.elastic.multiprocessing.api", "ddpkit.config_yaml", "ddpkit.data.builtin"]
    if cfg.model.arch not in ("cnn", "mlp") or cfg.data.dataset not in ("digits", "synthetic"):
        modules.append("torchvision")
    return modules  # not matplotlib: rank 0 alone draws curves.png, once training has ended


def train_command(cfg: Config, args, ctx: DistContext) -> int:
    """`ddpkit train`."""
    from ddpkit.distributed.health import Heartbeat, explain_comm_failures
    from ddpkit.trainer import Trainer

    with Heartbeat(ctx.rank, ctx.world_size) as heartbeat:
        with explain_comm_failures(ctx, heartbeat, lambda: 0):  # set-up collectives (DDP's broadcast, ...)
            trainer = Trainer(cfg, ctx, heartbeat)
        trainer.fit()
    return 0
