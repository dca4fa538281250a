"""Step 1 of the path: the starting point, one process on one device (no ddpkit distribution yet).

ResNet-18 on CIFAR-10, batch 256, 5 epochs, SGD lr 0.01:

    python examples/01_single_gpu.py --data cifar10    # needs CIFAR-10 in data/cifar-10-batches-py/
    python examples/01_single_gpu.py                   # scikit-learn's digits (no download)

Prints `   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%` every 50 steps and at the end of each epoch
(about 65% train accuracy on CIFAR-10 after 5 epochs); --data-root names another folder for the CIFAR-10
files. Step 2 changes one line of this script, step 3 ports it to DDP.
"""

from __future__ import annotations

import _common as common
import torch
from torch.utils.data import DataLoader

import ddpkit


def main(args, wrap=lambda model: model) -> None:
    """Train; `wrap` is the one line step 2 changes (nn.DataParallel)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ddpkit.seed_everything(0)
    train_set, _, spec = common.datasets(args)
    model = common.resnet18(spec.in_channels).to(device)
    net = wrap(model)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)  # one process sees everything
    optimizer = common.sgd(net, args.lr)

    print("            =======  Training  ======= \n", flush=True)
    for epoch in range(1, args.epochs + 1):
        common.train_epoch(net, loader, optimizer, device, epoch, args)
    print("\n            =======  Training Finished  ======= \n", flush=True)
    ddpkit.save_checkpoint({"model": model.state_dict()}, args.out)  # the bare model: keys without `module.`
    print(f"saved {args.out}")


if __name__ == "__main__":
    main(common.parser(__doc__).parse_args())
