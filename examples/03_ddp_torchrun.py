"""Step 3: DDP under torchrun, one process per GPU: step 1's script ported with ddpkit.prepare.

    torchrun --nproc-per-node 4 examples/03_ddp_torchrun.py --data cifar10    # needs 4 GPUs, CIFAR-10
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 22222 --nproc-per-node 8 \\
        examples/03_ddp_torchrun.py --data cifar10    # needs 2 nodes x 8 GPUs, CIFAR-10
    torchrun --nproc-per-node 2 examples/03_ddp_torchrun.py    # CPU: gloo, scikit-learn's digits

(on the second node the same line with --node-rank 1). What the tutorial writes by hand, ddpkit does:
init_distributed() reads RANK/LOCAL_RANK from the launcher and picks the device and the backend (nccl on
GPUs, gloo on CPU); prepare() moves the model there and wraps it in DistributedDataParallel, and turns the
shuffled DataLoader into this rank's share of DistributedSampler's order, set_epoch included. The batch is
per process: 256 x 4 GPUs = 1024 a step, and the lr follows the global batch (0.01 x 1024 / 256). As with
DistributedSampler each rank gets ceil(50,000 / 4) samples, padded with repeats: 49 steps an epoch (13 on
2 nodes x 8 GPUs); DataLoader(..., drop_last=True) would drop the incomplete last batch instead.
"""

from __future__ import annotations

import math

import _common as common
from torch.utils.data import DataLoader

import ddpkit


def main(args) -> None:
    ctx = ddpkit.init_distributed()  # what prepare() would also do; here for the [init] line
    common.print_line(f"[init] == local rank: {ctx.local_rank}, global rank: {ctx.rank} ==")
    train_set, _, spec = common.datasets(args)
    ddpkit.seed_everything(0)  # identical initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = common.resnet18(spec.in_channels)
    global_batch = args.batch_size * ctx.world_size
    lr = ddpkit.scaled_lr(args.lr, global_batch, 256)  # the linear scaling rule: 0.01 at 256, 0.02 at 512
    optimizer = common.sgd(model, lr)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)  # step 1's loader, unchanged
    net, optimizer, loader = ddpkit.prepare(model, optimizer, loader)  # the port: these three lines' objects
    ddpkit.seed_rank(0)  # seed + rank: each process its own augmentation stream

    if ctx.is_main:
        per_rank = math.ceil(len(train_set) / ctx.world_size)
        print(
            f"steps per epoch: {len(loader)} (ceil({len(train_set)} samples / {ctx.world_size} processes) = "
            f"{per_rank} per process, in batches of {args.batch_size})\n"
            f"lr: {lr:g} ({args.lr:g} x global batch {global_batch} / 256)",
            flush=True,
        )
        print("            =======  Training  ======= \n", flush=True)
    for epoch in range(1, args.epochs + 1):  # the loader calls set_epoch itself: a new order every epoch
        common.train_epoch(net, loader, optimizer, ctx.device, epoch, args)
    if ctx.is_main:
        print("\n            =======  Training Finished  ======= \n", flush=True)
        # the module inside the DDP wrapper: its keys, not the wrapper's `module.`-prefixed ones
        ddpkit.save_checkpoint({"model": ddpkit.unwrap(net).state_dict()}, args.out)
        print(f"saved {args.out}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main(common.parser(__doc__).parse_args())
