"""SCENARIOS A.3: DDP under torchrun (torch.distributed.launch): one process per GPU.

    torchrun --nproc-per-node 4 examples/03_ddp_torchrun.py --data cifar10 --data-root data     # 1 node x 4 GPUs
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 22222 --nproc-per-node 8 \\
        examples/03_ddp_torchrun.py --data cifar10 --data-root data    # then --node-rank 1 on the other node
    torchrun --nproc-per-node 2 examples/03_ddp_torchrun.py            # CPU: gloo, scikit-learn's digits

What the tutorial writes by hand, ddpkit does: RANK/LOCAL_RANK from the launcher, the device, the backend
(nccl on GPUs, gloo on CPU), the sampler and its set_epoch, and the lr for the global batch (0.01 x 2 on 2
GPUs). The batch is per process: 256 x 4 GPUs = 1024 a step, so CIFAR-10's 50,000 images make 48 steps an
epoch. The tutorial's DistributedSampler pads the last batch and shows 49 (13 on 2 nodes x 8 GPUs; ddpkit 12):
ddpkit drops the incomplete last global batch so that every rank runs the same steps.
"""

from __future__ import annotations

import math

import _common as common

import ddpkit


def main(args) -> None:
    ctx = ddpkit.init_distributed()
    common.print_line(f"[init] == local rank: {ctx.local_rank}, global rank: {ctx.rank} ==")
    train_set, _, spec = common.datasets(args)
    ddpkit.seed_model_init(0)  # identical initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = common.resnet18(spec.in_channels).to(ctx.device)
    net = common.ddp(model, ctx)
    ddpkit.seed_rank(0)  # seed + rank: each process its own augmentation stream
    loader = ddpkit.distributed_loader(train_set, args.batch_size, seed=0)
    global_batch = args.batch_size * ctx.world_size
    lr = ddpkit.scaled_lr(args.lr, global_batch, 256)  # the linear scaling rule: 0.01 at 256, 0.02 at 512
    optimizer = common.sgd(net, lr)

    if ctx.is_main:
        padded = math.ceil(math.ceil(len(train_set) / ctx.world_size) / args.batch_size)
        print(
            f"steps per epoch: {len(loader)} ({len(train_set)} samples // global batch {global_batch} = "
            f"{args.batch_size} x {ctx.world_size}); a padding DistributedSampler would give {padded}\n"
            f"lr: {lr:g} ({args.lr:g} x {global_batch} / 256)",
            flush=True,
        )
        print("            =======  Training  ======= \n", flush=True)
    for epoch in range(1, args.epochs + 1):  # the loader calls set_epoch itself: a new order every epoch
        common.train_epoch(net, loader, optimizer, ctx.device, epoch, args)
    if ctx.is_main:
        print("\n            =======  Training Finished  ======= \n", flush=True)
        # model is net.module: its keys, not the DDP wrapper's `module.`-prefixed ones
        ddpkit.save_checkpoint({"model": model.state_dict()}, args.out)
        print(f"saved {args.out}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main(common.parser(__doc__).parse_args())
