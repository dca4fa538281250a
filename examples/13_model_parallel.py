"""Step 13: model parallelism: the first half of a model on one device, the second half on another.

    python examples/13_model_parallel.py                             # one process, two GPUs (cuda:0, cuda:1)
    torchrun --nproc-per-node 2 examples/13_model_parallel.py        # + DDP: rank r owns cuda:2r, cuda:2r+1

The activations move from the first device to the second inside forward(), and autograd moves the gradients
back. Combined with DDP, each process owns both halves (several devices), so DDP is built by hand without
device_ids (ddpkit.prepare would move the whole model to one device). Without enough GPUs both "devices" are
the CPU: the code path is the same, only nothing moves.
"""

from __future__ import annotations

import _common as common
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit


class TwoDeviceNet(nn.Module):
    """common.small_cnn cut in two: the conv blocks on `first`, the classifier on `second`."""

    def __init__(self, in_channels: int, image_size: int, first: torch.device, second: torch.device):
        super().__init__()
        layers = common.small_cnn(in_channels, image_size)
        self.first, self.second = first, second
        self.part1 = layers[:6].to(first)
        self.part2 = layers[6:].to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.part1(x.to(self.first))
        return self.part2(x.to(self.second))  # the activations cross devices here


def main() -> None:
    args = common.parser(__doc__, batch_size=32, epochs=2, lr=0.4).parse_args()
    ctx = ddpkit.init_distributed(device="cpu" if torch.cuda.device_count() < 2 else "auto")
    if ctx.device.type == "cuda":
        first, second = torch.device("cuda", 2 * ctx.local_rank), torch.device("cuda", 2 * ctx.local_rank + 1)
    else:
        first = second = torch.device("cpu")
    train_set, _, spec = common.datasets(args)
    ddpkit.seed_everything(0)
    model = TwoDeviceNet(spec.in_channels, spec.image_size, first, second)
    common.print_line(f"rank {ctx.rank}: part1 on {first}, part2 on {second}")
    net = DistributedDataParallel(model) if ctx.world_size > 1 else model  # no device_ids: several devices
    loader = ddpkit.distributed_loader(train_set, args.batch_size)
    optimizer = common.sgd(net, ddpkit.scaled_lr(args.lr, args.batch_size * ctx.world_size, 256))
    for epoch in range(1, args.epochs + 1):
        loss, _ = common.train_epoch(net, loader, optimizer, first, epoch, args)
        loss = ddpkit.all_reduce_mean(loss)
        if ctx.is_main:
            print(
                f"epoch {epoch}/{args.epochs} | train loss {loss:.4f} (mean of {ctx.world_size} ranks)",
                flush=True,
            )
    sums = ddpkit.all_gather_object(common.checksum(model))
    assert len(set(sums)) == 1, f"the DDP replicas diverged: {sums}"
    if ctx.is_main:
        print(f"replicas identical after training: {sums}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
