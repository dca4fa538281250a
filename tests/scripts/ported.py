"""single_gpu.py made distributed with ddpkit: the same script, a handful of lines changed (marked `# ddpkit`),
plus a mid-run resume (`# resume`) and the test suite's crash hook (`# test hook`). It runs as `python ported.py`
(one process), under `ddpkit run --nproc-per-node N`, torchrun, srun or mpirun.

    ddpkit run --nproc-per-node 2 ported.py --epochs 3 --out model.pt --state state.pt
"""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader

import ddpkit  # ddpkit
from single_gpu import Blobs, build_model, collate


def resume(path, **objects):
    """The epoch to start from: 0, or where the state a crashed run saved says (it restores the objects)."""
    return ddpkit.load_state(path, **objects)["epoch"] if path and os.path.exists(path) else 0


def main(args):
    device = ddpkit.init_distributed().device  # ddpkit
    torch.manual_seed(0)
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(Blobs(1000, 1), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, persistent_workers=args.workers > 0)
    val_loader = DataLoader(Blobs(333, 2), batch_size=64, shuffle=False, collate_fn=collate)
    model, optimizer, train_loader, val_loader = ddpkit.prepare(model, optimizer, train_loader, val_loader)  # ddpkit
    start = resume(args.state, model=model, optimizer=optimizer, loader=train_loader)  # resume
    steps = 0  # test hook
    for epoch in range(start, args.epochs):  # resume
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            steps += 1  # test hook
            if steps == args.crash_after_steps:  # test hook: a crash in the middle of an epoch
                ddpkit.save_state(args.state, model=model, optimizer=optimizer, loader=train_loader, epoch=epoch)  # resume
                raise SystemExit(75)  # test hook
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
                total += len(y)
        correct, total = ddpkit.all_reduce_sum([correct, total])  # ddpkit
        if ddpkit.is_main_process():  # ddpkit
            print(f"epoch {epoch} | loss {loss.item():.4f} | val acc {correct / total:.4f} on {total} samples", flush=True)  # ddpkit
    if ddpkit.is_main_process():  # ddpkit
        torch.save(ddpkit.unwrap(model).state_dict(), args.out)  # ddpkit


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--out", default="model.pt")
    parser.add_argument("--state", default=None, help="resume from / save to this training state")
    parser.add_argument("--crash-after-steps", type=int, default=0)
    main(parser.parse_args())
