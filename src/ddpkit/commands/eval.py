"""`ddpkit eval`: score checkpoint.path on the validation set; the JSON line is rank 0's last stdout line."""

from __future__ import annotations

import json

from ddpkit import data
from ddpkit.checkpoint import load_checkpoint
from ddpkit.commands.train import check_inputs as preflight  # noqa: F401  (train's, out_dir aside)
from ddpkit.commands.train import model_and_data_modules
from ddpkit.config import Config, load_config
from ddpkit.data.text import tokenizer
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError
from ddpkit.launcher.warm_start import EVERY_WORKER
from ddpkit.parallel.strategy import Strategy
from ddpkit.train.builders import load_weights, make_autocast, make_datasets, make_model
from ddpkit.train.tasks import evaluate, task_for


def preload(cfg: Config) -> list[str]:
    """The modules every worker imports (imported once by the launch's fork server: cli.py)."""
    return [*EVERY_WORKER, __name__, "ddpkit.train.tasks", *model_and_data_modules(cfg)]


def eval_command(cfg: Config, args, ctx: DistContext) -> int:
    """The trainer's builders for the data and the model, the checkpoint's weights, then evaluate()."""
    path = cfg.checkpoint.path
    if not path:
        raise UserError(
            "ddpkit eval needs checkpoint.path", "add checkpoint.path=runs/NAME/checkpoints/best.pt"
        )
    state = load_checkpoint(path, map_location="cpu", require=("model",))
    if isinstance(state.get("config"), dict):  # the model and data it was trained on; command-line keys win
        cfg = load_config(args.config, args.overrides, base=state["config"])
    _, val_set, spec = make_datasets(cfg)
    tokenizer.check_trained_with(cfg, spec.tokenizer, state.get("tokenizer"), path)
    model = make_model(cfg, ctx, spec, for_eval=True)
    load_weights(Strategy(ctx), model, state, path, cfg.model.arch)
    batch_size = cfg.eval.batch_size or cfg.train.batch_size
    loader = data.eval_loader(
        val_set, batch_size, rank=ctx.rank, world_size=ctx.world_size, num_workers=cfg.data.num_workers
    )
    autocast = make_autocast(ctx.device, cfg.train.amp)
    result = evaluate(
        model,
        loader,
        ctx.device,
        autocast=autocast,
        channels_last=cfg.model.channels_last,
        task=task_for(spec),
    )
    if ctx.is_main:
        print(json.dumps({**result, "checkpoint": str(path), "world_size": ctx.world_size}), flush=True)
    return 0
