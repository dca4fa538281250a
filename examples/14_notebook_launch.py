"""Step 14: from a notebook: define a training function, run it on several processes with ddpkit.launch.

    python examples/14_notebook_launch.py               # 2 processes on CPU (gloo)

In a notebook the same two cells work: one defines `train`, the next runs
`results = ddpkit.launch(train, args, nprocs=2)`. ddpkit.launch starts the processes, each already in the
process group (by fork for a function defined in a notebook, which spawned processes could not import), runs
train(args) in each and returns their return values in rank order. Inside, train is step 1's code ported with
ddpkit.prepare, and the evaluation gathers every rank's predictions (ddpkit.gather, in data set order) to
score the whole validation set; with nprocs=1 the same function runs alone.
"""

from __future__ import annotations

import _common as common
import torch
from torch.utils.data import DataLoader

import ddpkit


def train(args) -> dict:
    """One rank's training and evaluation; returns what this rank saw and where it ended."""
    train_set, val_set, spec = common.datasets(args)
    ddpkit.seed_everything(0)
    model = common.small_cnn(spec.in_channels, spec.image_size)
    optimizer = common.sgd(model, ddpkit.scaled_lr(args.lr, args.batch_size * ddpkit.get_world_size(), 256))
    model, optimizer, train_loader, val_loader = ddpkit.prepare(
        model,
        optimizer,
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
        DataLoader(val_set, batch_size=256),
    )
    device = next(model.parameters()).device
    for epoch in range(1, args.epochs + 1):
        loss, _ = common.train_epoch(model, train_loader, optimizer, device, epoch, args)

    net = ddpkit.unwrap(model).eval()
    with torch.no_grad():
        batches = [(net(x.to(device)).argmax(dim=1).cpu(), y) for x, y in val_loader]
    predictions = ddpkit.gather(torch.cat([p for p, _ in batches]))  # every rank's, in data set order
    labels = ddpkit.gather(torch.cat([y for _, y in batches]))
    return {
        "rank": ddpkit.get_rank(),
        "train samples per epoch": len(train_loader.sampler),
        "last epoch's loss": round(loss, 4),
        "val samples scored here": sum(len(y) for _, y in batches),
        "val acc (all ranks)": round((predictions == labels).float().mean().item(), 4),
        "weights checksum": common.checksum(net),
    }


if __name__ == "__main__":
    parser = common.parser(__doc__, batch_size=32, epochs=2, lr=0.4)
    parser.add_argument("--nproc", type=int, default=2, help="processes to launch")
    args = parser.parse_args()
    results = ddpkit.launch(train, args, nprocs=args.nproc)  # the notebook's cell
    for result in results:
        print(result)
    checksums = {r["weights checksum"] for r in results}
    assert len(checksums) == 1, f"the replicas diverged: {checksums}"
