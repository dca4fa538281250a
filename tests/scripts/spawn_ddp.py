"""An mp.spawn DDP script, written the way the tutorials write it: `python spawn_ddp.py` starts all workers itself,
each sets MASTER_ADDR/MASTER_PORT and calls init_process_group with its rank. Nothing in it knows about ddpkit.
"""

import argparse
import os

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from torchrun_ddp import MyTrainDataset


def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ.setdefault("MASTER_PORT", "12355")
    init_process_group(backend="gloo", rank=rank, world_size=world_size)


def main(rank, world_size, args):
    ddp_setup(rank, world_size)
    torch.manual_seed(0)
    dataset = MyTrainDataset(2048)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    model = DDP(model)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            F.mse_loss(model(source), targets).backward()
            optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
        print(f"rank 0 of {world_size} saved {args.out}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(main, args=(args.world_size, args), nprocs=args.world_size)
