"""`ddpkit train`: the Trainer on every rank, after the checks that can fail before anything is written."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddpkit import data, models
from ddpkit.config import Config
from ddpkit.data.registry import get_dataset
from ddpkit.launcher.warm_start import EVERY_WORKER
from ddpkit.models import preload_for
from ddpkit.parallel.pipeline.plan import check_pipeline
from ddpkit.train.curves import LauncherCurves

if TYPE_CHECKING:  # torch loads when the command runs, not when its flags are parsed
    from ddpkit.distributed.runtime import DistContext


def check_inputs(cfg: Config) -> None:
    """The data, the model and checkpoint.resume, checked without reading them (train and eval)."""
    from ddpkit.checkpoint import check_file
    from ddpkit.checkpoint.background import check_async_save

    data.check_available(cfg)
    models.check_arch(cfg)
    check_pipeline(cfg)
    check_async_save(cfg)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_file(cfg.checkpoint.resume)


def preflight(cfg: Config) -> None:
    """Checks that run before any worker starts or any file is written: the inputs, then out_dir (a folder we
    may write, held by no live run, and holding no earlier run that this one would overwrite)."""
    from ddpkit.train import rundir

    check_inputs(cfg)
    rundir.preflight(cfg)


def model_and_data_modules(cfg: Config) -> list[str]:
    """The modules that build cfg's model and data sets (the trainer's builders and what they import, and what
    the model's family and the data set's entry say they need)."""
    modules = ["ddpkit.train.builders", "ddpkit.config.safe_yaml", "ddpkit.data.builtin"]
    wanted = [*preload_for(cfg.model.arch), *get_dataset(cfg.data.dataset).preload]
    return modules + sorted(set(wanted), key=wanted.index)


def preload(cfg: Config) -> list[str]:
    """The modules every worker imports: a launch imports them once, before the workers start."""
    # torch._dynamo too: torch's optimizers import it at their first step (it takes about as long as torch)

    extra = ["ddpkit.train.trainer", "torch._dynamo", "torch.utils.tensorboard"]
    return [
        *EVERY_WORKER,
        *extra,
        *model_and_data_modules(cfg),
    ]  # not matplotlib: the launcher draws curves.png


def in_launcher(cfg: Config, spec):
    """What the launcher of a one-node launch does for the run itself: draw curves.png (train/curves LauncherCurves)."""
    if not cfg.report.curves or spec.nnodes != 1:
        return None

    return LauncherCurves(cfg.out_dir)


def train_command(cfg: Config, args, ctx: DistContext) -> int:
    """`ddpkit train`."""
    from ddpkit.train.health import Heartbeat, explain_comm_failures
    from ddpkit.train.trainer import Trainer

    with Heartbeat(ctx.rank, ctx.world_size) as heartbeat:
        with explain_comm_failures(ctx, heartbeat, lambda: 0):  # set-up collectives (DDP's broadcast, ...)
            trainer = Trainer(cfg, ctx, heartbeat)
        trainer.fit()
    return 0
