"""Optimizer, learning-rate scaling (linear scaling rule) and the per-optimizer-step schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ddpkit.config import Config


def global_batch_size(batch_size: int, world_size: int, grad_accum_steps: int) -> int:
    """Samples per optimizer step over the whole job: per-process batch x processes x accumulation steps."""
    return int(batch_size) * int(world_size) * int(grad_accum_steps)


def scaled_lr(lr: float, global_batch: int, ref_batch_size: int | None) -> float:
    """Linear scaling rule: lr x global_batch / ref_batch_size; `ref_batch_size=None` leaves lr unchanged."""
    if ref_batch_size is None:
        return float(lr)
    if ref_batch_size <= 0:
        raise ValueError(f"ref_batch_size must be > 0, got {ref_batch_size}")
    return float(lr) * global_batch / ref_batch_size


def optimizer_spec(cfg: Config, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, keyword arguments) for cfg.optim; also what ZeroRedundancyOptimizer needs."""
    o = cfg.optim
    if o.name == "sgd":
        kwargs: dict[str, Any] = {"lr": lr, "momentum": o.momentum, "weight_decay": o.weight_decay}
        kwargs["nesterov"] = bool(o.nesterov and o.momentum > 0)  # torch refuses Nesterov without momentum
        return torch.optim.SGD, kwargs
    if o.name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": o.weight_decay}
    raise ValueError(f"unknown optim.name '{o.name}'")  # config validation catches this first


def build_optimizer(model: nn.Module, cfg: Config, lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW over the trainable parameters, with one weight decay for all of them (as the tutorials do).

    Design choice: biases and norm weights are decayed too, so a ddpkit run matches a hand-written
    `torch.optim.SGD(model.parameters(), ...)` script step for step.
    """
    cls, kwargs = optimizer_spec(cfg, lr)
    params = [p for p in model.parameters() if p.requires_grad]
    return cls(params, **kwargs)


def total_steps(epochs: int, steps_per_epoch: int, max_steps: int | None = None) -> int:
    """Optimizer steps of the whole run: epochs x optimizer steps per epoch, capped by train.max_steps."""
    total = int(epochs) * int(steps_per_epoch)
    return total if max_steps is None else min(total, int(max_steps))


def warmup_steps(cfg: Config, steps_per_epoch: int) -> int:
    """round(warmup_epochs x steps_per_epoch), at least 1 when any warmup is asked for."""
    w = cfg.optim.warmup_epochs
    return max(1, round(w * steps_per_epoch)) if w > 0 else 0


def lr_factor(
    step: int,
    *,
    schedule: str,
    total_steps: int,
    steps_per_epoch: int,
    warmup: int = 0,
    step_size: int = 30,
    gamma: float = 0.1,
) -> float:
    """The multiplier of the base lr for optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup for the first `warmup` steps, so it reaches the full lr on its last step.
    cosine: 0.5 (1 + cos(pi t)) with t going from 0 at the end of warmup to 1 at total_steps.
    step: gamma ** (epoch // step_size), with epoch = step // steps_per_epoch. constant: 1.
    """
    if schedule == "cosine":
        span = max(1, total_steps - warmup)
        t = min(1.0, max(0.0, (step - warmup) / span))
        factor = 0.5 * (1.0 + math.cos(math.pi * t))
    elif schedule == "step":
        epoch = step // max(1, steps_per_epoch)
        factor = gamma ** (epoch // max(1, step_size))
    elif schedule == "constant":
        factor = 1.0
    else:
        raise ValueError(f"unknown optim.schedule '{schedule}'")
    if step < warmup:
        factor *= (step + 1) / warmup
    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Config, steps_per_epoch: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """A LambdaLR to step once per OPTIMIZER step (steps_per_epoch counts optimizer steps, after accumulation).

    The schedule comes from cfg, not from the state_dict: state_dict/load_state_dict carry only the position
    (last_epoch), so a resumed run continues the same curve.
    """
    o = cfg.optim
    kwargs = {
        "schedule": o.schedule,
        "total_steps": int(total_steps),
        "steps_per_epoch": int(steps_per_epoch),
        "warmup": warmup_steps(cfg, steps_per_epoch),
        "step_size": o.step_size,
        "gamma": o.step_gamma,
    }
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kwargs))
