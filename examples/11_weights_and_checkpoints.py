"""SCENARIOS C.13, 16, 17: files the processes share: data prepared by rank 0, pretrained weights, checkpoints.

    torchrun --nproc-per-node 2 examples/11_weights_and_checkpoints.py --out runs/c_files/model.pt

C.16: rank 0 prepares the data (download, unpack, cache) while the others wait; then every rank reads it.
C.13: pretrained weights reach every process: each rank loads the file with a map_location to its own device
(or rank 0 alone loads them before DDP, whose constructor broadcasts rank 0's parameters).
C.17: rank 0 saves a checkpoint, a barrier, every rank loads it with a map_location and gets the same weights.
The script asserts each of these and exits non-zero if one fails.
"""

from __future__ import annotations

from pathlib import Path

import _common as common
import torch

import ddpkit


def same_weights(model, state) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def main() -> None:
    args = common.parser(__doc__, batch_size=32, epochs=1, lr=0.4).parse_args()
    ctx = ddpkit.init_distributed()
    work = Path(args.out).parent
    world = range(ctx.world_size)

    # C.16: rank 0 runs the block first; the others enter it after rank 0 has left it
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

    # C.13: pretrained weights (written here by rank 0), loaded on every rank onto its own device
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

    # C.17: train a little, rank 0 saves, barrier, every rank loads with map_location and compares
    net = common.ddp(model, ctx)
    dataset = torch.utils.data.TensorDataset(data["images"].cpu(), data["labels"].cpu())
    loader = ddpkit.distributed_loader(dataset, args.batch_size)
    common.train_epoch(net, loader, common.sgd(net, 0.05), ctx.device, 1, args)
    if ctx.is_main:
        ddpkit.save_checkpoint({"model": model.state_dict()}, args.out)  # model is net.module
    ddpkit.barrier()  # nobody reads the file before rank 0 has finished writing it
    checkpoint = ddpkit.load_checkpoint(args.out, map_location=ctx.device)
    restored = ddpkit.all_gather_object(same_weights(model, checkpoint["model"]))
    assert all(restored), (
        f"checkpoint differs from the model on ranks {[r for r in world if not restored[r]]}"
    )
    if ctx.is_main:
        print(f"checkpoint round trip: every rank's weights equal {args.out}: {restored}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
