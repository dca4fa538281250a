"""Exact evaluation: every validation sample of a sharded, duplicate-free loader scored once, summed over all
ranks; what is summed and which metrics fields it gives is the task's (classification or a language model)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit import data
from ddpkit.builders import to_device
from ddpkit.distributed.collectives import all_reduce_sum, is_dist
from ddpkit.tasks import EVAL_WIDTH, Classification, Task


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    device: torch.device,
    criterion: nn.Module | None = None,
    autocast=contextlib.nullcontext,
    collective_forward: bool = False,
    channels_last: bool = False,
    task: Task | None = None,
) -> dict[str, Any]:
    """Loss, top-1 and top-5 (a language model: loss per token and perplexity) over an exact (duplicate-free)
    sharded loader, summed over all ranks; `task` defaults to classification with `criterion`."""
    task = task or Classification(criterion)
    was_training = model.training
    model.eval()
    sums = torch.zeros(EVAL_WIDTH, dtype=torch.float64, device=device)
    batches = iter(loader)
    n_local = n_max = len(loader)
    if collective_forward and is_dist():
        t = torch.tensor([n_local], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_max = int(t.item())
    dummy = None
    for i in range(n_max):
        if i >= n_local:  # a rank with a shorter shard still joins the collective forward (fsdp)
            model(dummy if dummy is not None else _dummy_input(loader, device))
            continue
        x, y = to_device(*next(batches), device, channels_last)
        dummy = x[:1] if len(x) else dummy
        with autocast():
            logits = model(x).float()
        if not len(y):  # every sample of the batch was undecodable and left out (data.skip_corrupt)
            continue
        sums += task.eval_sums(logits, y)
    model.train(was_training)
    return task.val_fields(all_reduce_sum(sums).tolist())


def _dummy_input(loader, device: torch.device) -> torch.Tensor:
    ds = loader.dataset
    x, _ = ds.first_decodable() if isinstance(ds, data.CheckedSamples) and ds.skip else ds[0]
    return x.unsqueeze(0).to(device)


__all__ = ["evaluate"]
