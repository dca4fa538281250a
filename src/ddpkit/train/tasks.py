"""What is learnt: image classification or next-token language modelling, one small object each.

A task says how a batch's loss is computed, what a training step counts (samples and correct answers, or
tokens), what an evaluation sums over the validation set, which metrics fields those sums become, which
checkpoint is the best and how an epoch reads in the log. The trainer and `ddpkit eval` ask it, and so does
`evaluate()` below: every validation sample of a sharded, duplicate-free loader scored once, summed over all ranks.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddpkit import data
from ddpkit.distributed.collectives import all_reduce_sum, is_dist
from ddpkit.train.builders import to_device

if TYPE_CHECKING:
    from ddpkit.data import DataSpec
    from ddpkit.train.metrics import RunningSums
    from ddpkit.train.train_state import TrainState

EVAL_WIDTH = 5  # evaluation sums: [loss sum, top-1 hits, top-5 hits, samples, units (samples or tokens)]


def _joined(*parts: str | bool) -> str:
    """The parts of an epoch line that are there (a part is False when the epoch has no such numbers)."""
    return " | ".join(p for p in parts if isinstance(p, str))


def _rate(count: float, elapsed: float) -> float | None:
    return round(count / elapsed, 2) if elapsed > 0 else None


class Classification:
    """Labelled images: cross-entropy of the logits (N, classes); top-1 and top-5 accuracy."""

    accuracy = True  # train_acc1 / val_acc1 / val_acc5 are measured (accumulate reads a step's logits)

    def __init__(self, criterion: nn.Module | None = None):
        self.criterion = criterion or nn.CrossEntropyLoss()

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(logits.float(), y)

    def accumulate(
        self, sums: RunningSums, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor
    ) -> None:
        sums.add(loss, logits, y)

    def eval_sums(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]
        n = torch.tensor(float(y.shape[0]), device=logits.device, dtype=torch.float64)
        loss = self.criterion(logits, y) * y.shape[0]
        return torch.stack([loss.double(), hit[:, 0].sum().double(), hit.any(dim=1).sum().double(), n, n])

    def val_fields(self, sums: list[float]) -> dict[str, Any]:
        loss_sum, top1, top5, n, _ = sums
        return {
            "val_loss": loss_sum / n if n else None,
            "val_acc1": top1 / n if n else None,
            "val_acc5": top5 / n if n else None,
            "val_ppl": None,
            "val_samples": int(n),
        }

    def train_fields(self, loss: float, acc1: float | None, units: int, elapsed: float) -> dict[str, Any]:
        return {
            "train_loss": loss,
            "train_acc1": acc1,
            "train_images_per_s": _rate(units, elapsed),
            "train_tokens_per_s": None,
        }

    def improves(self, row: dict[str, Any], state: TrainState) -> bool:
        """Whether `row` is the best so far (the highest val_acc1); records it in `state`."""
        if row["val_acc1"] is None or row["val_acc1"] <= state.best_acc1:
            return False
        state.best_acc1 = row["val_acc1"]
        return True

    def epoch_text(self, row: dict[str, Any]) -> str:
        train = f"train loss {row['train_loss']:.4f} acc {100 * row['train_acc1']:.2f}%"
        val = (
            row["val_loss"] is not None
            and f"val loss {row['val_loss']:.4f} acc1 {100 * row['val_acc1']:.2f}%"
        )
        return _joined(train, val, f"{row['train_images_per_s']} img/s")


class LanguageModel:
    """Token sequences: mean next-token cross-entropy of the logits (N, T, vocab); perplexity; tokens/s."""

    accuracy = False  # accumulate counts tokens: it needs no logits (a pipeline's last stage keeps none)

    def __init__(self, block_size: int):
        self.block_size = block_size

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def accumulate(
        self, sums: RunningSums, loss: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor
    ) -> None:
        sums.count(loss, 0, y.numel())

    def eval_sums(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").double()
        counts = [0.0, 0.0, float(y.shape[0]), float(y.numel())]
        return torch.cat([loss[None], torch.tensor(counts, device=logits.device, dtype=torch.float64)])

    def val_fields(self, sums: list[float]) -> dict[str, Any]:
        loss_sum, _, _, n, tokens = sums
        loss = loss_sum / tokens if tokens else None
        return {
            "val_loss": loss,
            "val_acc1": None,
            "val_acc5": None,
            "val_ppl": math.exp(min(loss, 700.0)) if loss is not None else None,
            "val_samples": int(n),
        }

    def train_fields(self, loss: float, acc1: float | None, units: int, elapsed: float) -> dict[str, Any]:
        return {
            "train_loss": loss,
            "train_acc1": None,
            "train_images_per_s": _rate(units / self.block_size, elapsed),
            "train_tokens_per_s": _rate(units, elapsed),
        }

    def improves(self, row: dict[str, Any], state: TrainState) -> bool:
        """Whether `row` is the best so far (the lowest val_loss); records it in `state`."""
        loss, best = row["val_loss"], state.best_val_loss
        if loss is None or (best is not None and loss >= best):
            return False
        state.best_val_loss = loss
        return True

    def epoch_text(self, row: dict[str, Any]) -> str:
        val = row["val_loss"] is not None and f"val loss {row['val_loss']:.4f} ppl {row['val_ppl']:.2f}"
        return _joined(f"train loss {row['train_loss']:.4f}", val, f"{row['train_tokens_per_s']} tokens/s")


Task = Classification | LanguageModel


def task_for(spec: DataSpec, criterion: nn.Module | None = None) -> Task:
    """The task the data asks for: a language model on token data, else classification with `criterion`."""
    if spec.tokens:
        return LanguageModel(int(spec.block_size or 0))
    return Classification(criterion)


# ---------------------------------------------------------------------------------------------- evaluation


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
    counts: bool = True,
) -> dict[str, Any]:
    """Loss, top-1 and top-5 (a language model: loss per token and perplexity) over an exact (duplicate-free)
    sharded loader, summed over all ranks; `task` defaults to classification with `criterion`.

    `counts`: false on the ranks whose sums another rank of their dp replica already holds (tensor-parallel
    peers): they run every forward but add nothing."""
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
    return task.val_fields(all_reduce_sum(sums if counts else torch.zeros_like(sums)).tolist())


def _dummy_input(loader, device: torch.device) -> torch.Tensor:

    ds = loader.dataset
    x, _ = ds.first_decodable() if isinstance(ds, data.CheckedSamples) and ds.skip else ds[0]
    return x.unsqueeze(0).to(device)


__all__ = ["Classification", "LanguageModel", "Task", "evaluate", "task_for"]
