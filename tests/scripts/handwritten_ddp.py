"""single_gpu.py made distributed by hand, the way the tutorials teach it: read the launcher's variables,
init_process_group, pick the device, wrap in DDP, a DistributedSampler with set_epoch, sum the validation counts
with all_reduce, save on rank 0.

    torchrun --nproc-per-node 2 handwritten_ddp.py --epochs 3 --out model.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from single_gpu import Blobs, build_model, collate


def main(args):
    rank, local_rank, world_size = (
        int(os.environ["RANK"]),
        int(os.environ["LOCAL_RANK"]),
        int(os.environ["WORLD_SIZE"]),
    )
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    train_set, val_set = Blobs(1000, 1), Blobs(333, 2)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=collate,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=args.workers > 0,
    )
    val_loader = DataLoader(val_set, batch_size=64, shuffle=False, collate_fn=collate)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (model.module(x.to(device)).argmax(1) == y.to(device)).sum().item()
                    total += len(y)
            print(
                f"epoch {epoch} | loss {loss.item():.4f} | val acc {correct / total:.4f} on {total} samples",
                flush=True,
            )
        dist.barrier()
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--out", default="model.pt")
    main(parser.parse_args())
