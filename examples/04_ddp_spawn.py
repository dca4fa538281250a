"""SCENARIOS A.4: DDP under torch.multiprocessing.spawn: one command starts all the workers itself.

    python examples/04_ddp_spawn.py --nproc 4 --data cifar10 --data-root data     # 1 node x 4 GPUs
    python examples/04_ddp_spawn.py --nproc 2                                     # CPU: gloo, the digits

The parent picks a free port and gives every child the variables a launcher would (MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE); each child then runs the A.3 script, whose
ddpkit.init_distributed() finds them.
"""

from __future__ import annotations

import importlib
import os

import _common as common
import torch
import torch.multiprocessing as mp

from ddpkit.distributed.launch import free_port

train = importlib.import_module("03_ddp_torchrun").main  # a digit-leading name: no import statement


def worker(local_rank: int, nproc: int, port: int, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),  # one node: rank = local rank
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )
    train(args)


if __name__ == "__main__":
    parser = common.parser(__doc__)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2, help="workers to start")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: CPU workers must not oversubscribe
    mp.spawn(worker, args=(args.nproc, free_port(), args), nprocs=args.nproc)
