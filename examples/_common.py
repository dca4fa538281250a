"""What the example scripts share: their size flags, the tutorials' data, models, training and evaluation.

Not part of ddpkit: a user keeps these lines in their own script. They sit here so that each example shows
only what its step of the path changes.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

import ddpkit

# The tutorials' log line: `   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%` (running means).
LOG_LINE = "   == step: [{:3}/{}] [{}/{}] | loss: {:.3f} | acc: {:6.3f}%"


def print_line(text: str) -> None:
    """Print one line in one write: under `python -u` print() writes the text and the newline apart, and the
    lines of several processes sharing a terminal interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def parser(doc: str, *, batch_size: int = 256, epochs: int = 5, lr: float = 0.01) -> argparse.ArgumentParser:
    """The flags every example takes: the tutorial's sizes by default, tiny ones in the tests."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", choices=("digits", "cifar10"), default="digits", help="default: scikit-learn's digits"
    )
    p.add_argument(
        "--data-root", default="data", help="the folder holding cifar-10-batches-py/ (--data cifar10)"
    )
    p.add_argument("--train-size", type=int, help="train on the first N samples only (quick runs)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=batch_size, help="per process")
    p.add_argument(
        "--lr", type=float, default=lr, help="at a global batch of 256; it follows the global batch"
    )
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    p.add_argument("--out", default="runs/examples/model.pt", help="where rank 0 saves the trained weights")
    return p


def datasets(args: argparse.Namespace):
    """(train set with the tutorials' augmentation, val set, DataSpec) for --data."""
    from ddpkit.config import load_config
    from ddpkit.data import build_datasets

    cfg = load_config(None, [f"data.dataset={args.data}", f"data.root={args.data_root}"])
    train, val, spec = build_datasets(cfg)  # CIFAR-10: RandomCrop(32, 4), flip, the tutorials' mean and std
    if args.train_size:
        train = Subset(train, range(min(args.train_size, len(train))))
    return train, val, spec


def resnet18(in_channels: int) -> nn.Module:
    """torchvision's ResNet-18 with 10 classes, as the tutorials build it; gray digits: a 1-channel stem."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def small_cnn(in_channels: int, image_size: int) -> nn.Sequential:
    """The MNIST tutorials' small convnet: two conv blocks (layers 0-5), then the classifier (6-7)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (image_size // 4) ** 2, 10),
    )


def sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The tutorials' optimizer: SGD, momentum 0.9, weight decay 1e-4, Nesterov."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)


def train_epoch(model: nn.Module, loader, optimizer, device, epoch: int, args) -> tuple[float, float]:
    """One epoch of the tutorials' loop (rank 0 prints LOG_LINE); returns this rank's (mean loss, accuracy)."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    train_loss = correct = total = 0
    for idx, (inputs, targets) in enumerate(loader):
        outputs = model(inputs.to(device))
        targets = targets.to(outputs.device)  # where the output is (model parallel: the last device)
        loss = criterion(outputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_loss += loss.item()
        total += targets.size(0)
        correct += (outputs.argmax(dim=1) == targets).sum().item()
        if ddpkit.is_main_process() and ((idx + 1) % args.log_every == 0 or idx + 1 == len(loader)):
            acc = 100.0 * correct / total
            print(
                LOG_LINE.format(idx + 1, len(loader), epoch, args.epochs, train_loss / (idx + 1), acc),
                flush=True,
            )
    return train_loss / max(len(loader), 1), correct / max(total, 1)


def checksum(model: nn.Module) -> float:
    """The sum of every parameter: equal on two ranks when their replicas are (to 8 decimals)."""
    return round(sum(p.double().sum().item() for p in model.parameters()), 8)


@torch.no_grad()
def evaluate(model: nn.Module, loader, device) -> tuple[float, int]:
    """(accuracy, samples) over the whole validation set: each rank counts its own shard (an evaluation
    loader gives every sample to exactly one rank) and all_reduce_sum adds the counts up."""
    model.eval()
    correct = total = 0
    for inputs, targets in loader:
        correct += (model(inputs.to(device)).argmax(dim=1).cpu() == targets).sum().item()
        total += targets.size(0)
    correct, total = ddpkit.all_reduce_sum([correct, total])
    return correct / total, total


def train_and_evaluate(ctx, args: argparse.Namespace) -> None:
    """The MNIST tutorials' job on a distributed split: the loss averaged over ranks, exact val accuracy."""
    train_set, val_set, spec = datasets(args)
    ddpkit.seed_everything(0)  # the same initial weights on every rank
    model = small_cnn(spec.in_channels, spec.image_size)
    optimizer = sgd(model, ddpkit.scaled_lr(args.lr, args.batch_size * ctx.world_size, 256))
    # shuffled -> this rank's share of each epoch (set_epoch automatic); unshuffled -> each sample once
    net, optimizer, train_loader, val_loader = ddpkit.prepare(
        model,
        optimizer,
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True),
        DataLoader(val_set, batch_size=256),
    )
    for epoch in range(1, args.epochs + 1):
        loss, _ = train_epoch(net, train_loader, optimizer, ctx.device, epoch, args)
        loss = ddpkit.all_reduce_mean(loss)  # every rank's mean loss, averaged
        acc, samples = evaluate(ddpkit.unwrap(net), val_loader, ctx.device)
        if ctx.is_main:
            print(
                f"epoch {epoch}/{args.epochs} | train loss {loss:.4f} (mean of {ctx.world_size} ranks) | "
                f"val acc {100 * acc:.2f}% on {samples} samples",
                flush=True,
            )
    if ctx.is_main:
        ddpkit.save_checkpoint({"model": ddpkit.unwrap(net).state_dict()}, args.out)
        print(f"saved {args.out}", flush=True)
