"""Step 10: the rules every DDP script follows, each shown once and checked.

    torchrun --nproc-per-node 2 examples/10_ddp_rules.py
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --nproc-per-node 2 \\
        examples/10_ddp_rules.py    # needs 2 nodes

(on the second node the same line with --node-rank 1: the local ranks are then 0 1 0 1 and the ranks 0 1 2 3).
1. Every process has a rank, a local rank and a device; 2. the batch is per process, so the global batch and
the lr grow with the processes; 3. the same seed for the model (identical replicas), seed + rank for
augmentation (different streams); 4. a metric means something only averaged over the processes (all_reduce);
5. only rank 0 prints and saves, and it saves the model inside the DDP wrapper. The script asserts what it
shows and exits non-zero if a rule is broken.
"""

from __future__ import annotations

import _common as common
from torch.utils.data import DataLoader

import ddpkit


def main() -> None:
    args = common.parser(__doc__, batch_size=32, epochs=1, lr=0.4).parse_args()
    # 1. one line per process, in any order
    ctx = ddpkit.init_distributed()
    rank, local_rank, world_size, device, backend = ctx
    common.print_line(
        f"rank {rank} | local_rank {local_rank} | world_size {world_size} | device {device} | {backend}"
    )
    main_process = ddpkit.is_main_process()

    # 2. the loader's batch is per process; the global batch is that x world_size, and the lr follows it
    train_set, _, spec = common.datasets(args)
    plain = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    loader = ddpkit.prepare(plain)  # this rank's share of every epoch
    global_batch = args.batch_size * world_size
    lr = ddpkit.scaled_lr(args.lr, global_batch, 256)
    if main_process:
        print(f"batch {args.batch_size} per process x {world_size} processes = global batch {global_batch}")
        print(f"lr {args.lr:g} at batch 256 -> {lr:g} at {global_batch}")
        print(
            f"steps per epoch: {len(loader)} "
            f"(a plain DataLoader: {len(plain)}, each process sees the whole set)"
        )

    # 3. the same seed for the model (identical replicas), seed + rank for augmentation (own streams)
    ddpkit.seed_everything(0)
    model = common.small_cnn(spec.in_channels, spec.image_size)
    inits = ddpkit.all_gather_object(common.checksum(model))
    ddpkit.seed_rank(0)
    augmented = ddpkit.all_gather_object(round(sum(float(train_set[i][0].sum()) for i in range(8)), 4))
    assert len(set(inits)) == 1, f"initial weights differ between ranks: {inits}"
    assert len(set(augmented)) == world_size, f"augmentation repeats between ranks: {augmented}"
    if main_process:
        print(f"init checksum per rank: {inits} (identical)")
        print(f"augmented samples 0-7 checksum per rank: {augmented} (different)")

    # 4. a loss averaged over the processes with all_reduce
    net = ddpkit.prepare(model)  # on this rank's device, inside DistributedDataParallel
    loss, _ = common.train_epoch(net, loader, common.sgd(net, lr), device, 1, args)
    losses, mean = ddpkit.all_gather_object(loss), ddpkit.all_reduce_mean(loss)
    assert abs(mean - sum(losses) / world_size) < 1e-9
    if main_process:
        print(f"train loss per rank {[round(x, 4) for x in losses]} -> all_reduce mean {mean:.4f}")

    # 5. print and save on rank 0 only; save the model inside the DDP wrapper (net.module, which
    # ddpkit.unwrap returns): its keys have no `module.` prefix, so a model without DDP loads them
    if main_process:
        ddpkit.save_checkpoint({"model": ddpkit.unwrap(net).state_dict()}, args.out)
        print(f"rank 0 saved net.module.state_dict() to {args.out}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
