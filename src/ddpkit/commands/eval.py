"""`ddpkit eval`: score checkpoint.path on the validation set; the JSON line is rank 0's last stdout line."""

from __future__ import annotations

import contextlib
import json

import torch

from ddpkit import config as config_mod
from ddpkit.checkpoint import load_checkpoint
from ddpkit.commands.train import preflight  # noqa: F401  (the same checks as train)
from ddpkit.config import Config
from ddpkit.distributed.collectives import seed_model_init
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError, first_line
from ddpkit.trainer import evaluate


def eval_command(cfg: Config, args, ctx: DistContext) -> int:
    """`ddpkit eval`: score checkpoint.path on the validation set; the JSON line is rank 0's last stdout line."""
    from ddpkit import data, models

    if not cfg.checkpoint.path:
        raise UserError(
            "ddpkit eval needs checkpoint.path", "add checkpoint.path=runs/NAME/checkpoints/best.pt"
        )
    state = load_checkpoint(cfg.checkpoint.path, map_location="cpu", require=("model",))
    # The checkpoint's own config says which model and data it was trained on; command-line keys still win.
    if isinstance(state.get("config"), dict):
        cfg = config_mod.load_config(args.config, args.overrides, base=state["config"])
    _, val_set, spec = data.build_datasets(cfg)
    seed_model_init(cfg.seed)
    model = models.build_model(
        cfg, cfg.model.num_classes or spec.num_classes, spec.in_channels, spec.image_size
    )
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        first = first_line(e)
        raise UserError(
            f"checkpoint '{cfg.checkpoint.path}' does not fit model.arch={cfg.model.arch}: {first}",
            "pass the model.* settings it was trained with",
        ) from None
    model = models.prepare_model(model, cfg, ctx.device, distributed=False)
    loader = data.eval_loader(
        val_set,
        cfg.eval.batch_size or cfg.train.batch_size,
        num_workers=cfg.data.num_workers,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.amp]
    autocast = (lambda: torch.autocast(ctx.device.type, dtype=amp)) if amp else contextlib.nullcontext
    result = evaluate(model, loader, ctx.device, autocast=autocast, channels_last=cfg.model.channels_last)
    if ctx.is_main:
        print(
            json.dumps({**result, "checkpoint": str(cfg.checkpoint.path), "world_size": ctx.world_size}),
            flush=True,
        )
    return 0
