"""Step 4: DDP started by one command that spawns its own workers (no torchrun): step 3's script in each.

    python examples/04_ddp_spawn.py --nproc 4 --data cifar10 --data-root data    # needs 4 GPUs, CIFAR-10
    python examples/04_ddp_spawn.py --nproc 2              # the tutorial's mp.spawn, on CPU (gloo)
    python examples/04_ddp_spawn.py --nproc 2 --launch     # the same with ddpkit.launch

The tutorial's way: the parent sets MASTER_ADDR and MASTER_PORT (a free port here),
torch.multiprocessing.spawn calls worker(i, ...) in N processes, and each joins the group with its rank and
the world size, here ddpkit.init_distributed(rank=i, world_size=N) in place of init_process_group.
ddpkit.launch(fn, *args, nprocs=N) does all of that (free port, variables, joining, leaving) and returns each
rank's return value.
"""

from __future__ import annotations

import importlib
import os

import _common as common
import torch
import torch.multiprocessing as mp

import ddpkit
from ddpkit.launcher.launch import free_port

ddp_torchrun = importlib.import_module("03_ddp_torchrun")


def worker(local_rank: int, nproc: int, args) -> None:
    """What mp.spawn runs in each process: join the group as rank `local_rank` (one node), then train."""
    ddpkit.init_distributed(rank=local_rank, world_size=nproc)  # MASTER_ADDR/MASTER_PORT from the parent
    ddp_torchrun.main(args)


if __name__ == "__main__":
    parser = common.parser(__doc__)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2, help="workers to start")
    parser.add_argument("--launch", action="store_true", help="start them with ddpkit.launch, not mp.spawn")
    args = parser.parse_args()
    if args.launch:
        ddpkit.launch(ddp_torchrun.main, args, nprocs=args.nproc)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: CPU workers must not oversubscribe
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc)
