"""Step 11: the files the processes share: data prepared by rank 0, pretrained weights, checkpoints, resuming.

    torchrun --nproc-per-node 2 examples/11_weights_and_checkpoints.py --out runs/examples/model.pt

1. Rank 0 prepares the data (download, unpack, cache) while the others wait; then every rank reads it.
2. Pretrained weights reach every process: each rank loads the file with a map_location to its own device
   (or rank 0 alone loads them before DDP, whose constructor broadcasts rank 0's parameters).
3. Rank 0 saves the weights, a barrier, every rank loads them with a map_location and gets the same weights.
4. The whole training state (model, optimizer, the loader's place in its epochs, every rank's random streams)
   goes through ddpkit.save_state / load_state, which do 3. for you; a resumed epoch retrains to the same
   weights. The script asserts each of these and exits non-zero if one fails.
"""

from __future__ import annotations

from pathlib import Path

import _common as common
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddpkit


def same_weights(model, state) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def main() -> None:
    parser = common.parser(__doc__, batch_size=32, epochs=2, lr=0.4)
    ddpkit.seed_everything(0, deterministic=True)  # 4. repeats bit for bit on GPUs too (cuDNN, cuBLAS)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the last one is trained, then resumed and trained again")
    ctx = ddpkit.init_distributed()
    work = Path(args.out).parent
    world = range(ctx.world_size)

    # 1. rank 0 runs the block first; the others enter it after rank 0 has left it
    prepared = work / f"{args.data}_train_{args.train_size or 'all'}.pt"
    with ddpkit.rank_zero_first():
        wrote = not prepared.exists()
        if wrote:
            train_set, _, _ = common.datasets(args)
            samples = [train_set[i] for i in range(len(train_set))]
            work.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "images": torch.stack([x for x, _ in samples]),
                    "labels": torch.tensor([y for _, y in samples]),
                },
                prepared,
            )
        data = torch.load(prepared, map_location=ctx.device, weights_only=True)
    writers = [r for r, w in zip(world, ddpkit.all_gather_object(wrote), strict=True) if w]
    assert set(writers) <= {0}, f"ranks {writers} prepared the data again"
    if ctx.is_main:
        print(f"data prepared by rank 0 ({len(data['labels'])} samples), read by all {ctx.world_size} ranks")

    # 2. pretrained weights (written here by rank 0), loaded on every rank onto its own device
    n_channels, size = data["images"].shape[1], data["images"].shape[-1]
    pretrained = work / "pretrained.pt"
    if ctx.is_main:
        ddpkit.seed_everything(1234)
        ddpkit.save_checkpoint({"model": common.small_cnn(n_channels, size).state_dict()}, pretrained)
    ddpkit.barrier()
    ddpkit.seed_rank(0)  # every rank starts from a different random init ...
    model = common.small_cnn(n_channels, size).to(ctx.device)
    before = ddpkit.all_gather_object(common.checksum(model))
    model.load_state_dict(ddpkit.load_checkpoint(pretrained, map_location=ctx.device)["model"])
    after = ddpkit.all_gather_object(common.checksum(model))  # ... and every rank ends with the same weights
    assert len(set(before)) == ctx.world_size and len(set(after)) == 1, (before, after)
    if ctx.is_main:
        print(f"weights per rank: random init {before} -> after loading {pretrained.name} {after}")

    # 3. train a little, rank 0 saves, barrier, every rank loads with map_location and compares
    dataset = TensorDataset(data["images"].cpu(), data["labels"].cpu())
    net = ddpkit.prepare(model)
    optimizer = common.sgd(net, 0.05)
    loader = ddpkit.prepare(DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))
    for epoch in range(1, args.epochs):
        common.train_epoch(net, loader, optimizer, ctx.device, epoch, args)
    if ctx.is_main:
        ddpkit.save_checkpoint({"model": ddpkit.unwrap(net).state_dict()}, args.out)  # net.module
    ddpkit.barrier()  # nobody reads the file before rank 0 has finished writing it
    checkpoint = ddpkit.load_checkpoint(args.out, map_location=ctx.device)
    restored = ddpkit.all_gather_object(same_weights(model, checkpoint["model"]))
    assert all(restored), (
        f"checkpoint differs from the model on ranks {[r for r in world if not restored[r]]}"
    )
    if ctx.is_main:
        print(f"checkpoint round trip: every rank's weights equal {args.out}: {restored}", flush=True)

    # 4. save the whole state, train the last epoch, go back to the saved state, train it again
    resume = work / "resume.pt"
    ddpkit.save_state(resume, model=net, optimizer=optimizer, loader=loader, epoch=args.epochs - 1)
    common.train_epoch(net, loader, optimizer, ctx.device, args.epochs, args)
    trained = ddpkit.all_gather_object(common.checksum(model))
    extra = ddpkit.load_state(resume, model=net, optimizer=optimizer, loader=loader)
    common.train_epoch(net, loader, optimizer, ctx.device, extra["epoch"] + 1, args)
    retrained = ddpkit.all_gather_object(common.checksum(model))
    assert retrained == trained, f"the resumed epoch ended elsewhere: {trained} then {retrained}"
    if ctx.is_main:
        print(
            f"resumed after epoch {extra['epoch']}: "
            f"epoch {args.epochs} retrained to the same weights {retrained}"
        )
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
