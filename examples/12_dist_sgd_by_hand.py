"""Step 12: what DDP does, written by hand: distributed SGD that all-reduces the gradients, next to DDP.

    python examples/12_dist_sgd_by_hand.py                          # one process
    torchrun --nproc-per-node 2 examples/12_dist_sgd_by_hand.py     # two processes (gloo on CPU)

Every process draws the same shuffle of the digits data set (fixed seed), keeps its fraction 1/N of it, and
trains on batches of 128/N. After backward() it all-reduces every gradient and divides it by N: each rank then
holds the gradient of the global batch of 128 and takes the same step. DDP computes the same average, in
buckets that overlap the communication with the backward pass, so both give the same weights; rank 0 prints
how far apart they ended.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

import ddpkit
from ddpkit.models import build_mlp

GLOBAL_BATCH = 128
SHUFFLE_SEED = 1234
MODES = ("by_hand", "ddp", "local")  # local: no gradient sync at all, so the ranks drift apart


def digits() -> TensorDataset:
    """scikit-learn's 1797 handwritten 8x8 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(images, torch.tensor(bunch.target))


def partition(dataset: Dataset, rank: int, world_size: int, seed: int = SHUFFLE_SEED) -> Subset:
    """This rank's fraction 1/world_size of one shuffle that every rank draws with the same seed."""
    indices = list(range(len(dataset)))  # type: ignore[arg-type]
    random.Random(seed).shuffle(indices)
    size = len(indices) // world_size
    return Subset(dataset, indices[rank * size : (rank + 1) * size])


def average_gradients(model: nn.Module) -> None:
    """All-reduce (sum) every gradient over the ranks, then divide it by the number of ranks."""
    world_size = ddpkit.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.copy_(ddpkit.all_reduce_sum(p.grad) / world_size)


def train(
    mode: str, steps: int, seed: int = 0, device: torch.device | str = "cpu", lr: float = 0.1
) -> nn.Module:
    """`steps` SGD steps on this rank's partition, gradients synced `by_hand`, by `ddp` or not (`local`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    rank, world_size = ddpkit.get_rank(), ddpkit.get_world_size()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = build_mlp(num_classes=10, in_channels=1, image_size=8, hidden=(64, 32)).to(
        device
    )  # no normalisation
    net = DDP(model) if mode == "ddp" else model
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.5)
    loader = DataLoader(
        partition(digits(), rank, world_size),
        batch_size=GLOBAL_BATCH // world_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed + rank),
    )
    step = 0
    while step < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x.to(device)), y.to(device))
            loss.backward()
            if mode == "by_hand":
                average_gradients(model)
            optimizer.step()
            step += 1
            if step == steps:
                break
    return model


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, device: torch.device | str = "cpu") -> float:
    """Fraction of the whole data set classified correctly."""
    images, labels = dataset.tensors
    return (model(images.to(device)).argmax(1).cpu() == labels).float().mean().item()


def main() -> None:
    """Train by hand and with DDP from the same start; rank 0 prints how far apart the weights ended."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    steps = parser.parse_args().steps
    rank, local_rank, world_size, device, backend = ddpkit.init_distributed()
    if not dist.is_initialized():  # one process: DDP still wants a process group, here of one rank
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    by_hand, ddp = (train(mode, steps, device=device) for mode in ("by_hand", "ddp"))
    gap = max((a - b).abs().max().item() for a, b in zip(by_hand.parameters(), ddp.parameters(), strict=True))
    if ddpkit.is_main_process():
        print(
            f"{world_size} process(es) ({backend}), batch {GLOBAL_BATCH // world_size} each, {steps} steps: "
            f"accuracy by hand {accuracy(by_hand, digits(), device):.3f}, "
            f"DDP {accuracy(ddp, digits(), device):.3f}; "
            f"largest weight difference {gap:.2e}"
        )
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
