"""The library path: a user's script ported with `ddpkit.prepare` and started with `ddpkit run`, against the same
script hand-written for torchrun and started with torchrun.

One training script, written twice as a user would (resnet18 from torchvision, 10 classes, on 32x32 images held
in memory as a TensorDataset, a plain DataLoader, SGD with momentum, cross-entropy):

  torchrun  the hand-written DDP script of the tutorials: init_process_group, DistributedSampler + set_epoch,
            DistributedDataParallel, started as `torchrun --nproc-per-node 2 script.py`
  ported    the single-process script with the lines ddpkit's README adds (init_distributed, prepare(model,
            optimizer, loader)), started as `ddpkit run --nproc-per-node 2 script.py`
  unchanged the torchrun script itself under `ddpkit run --nproc-per-node 2` (the launcher alone)

Both scripts time each epoch from its first batch to its last optimizer step (after a barrier) and print one JSON
line per epoch; images/s = the images of epochs 2 .. E / their time (epoch 1 warms up). The sides alternate per
round (A B C, C B A, ...), one thread per rank (OMP_NUM_THREADS=1); the report gives the medians, the ratio to
torchrun (target >= 0.97) and the load average and the CPU other processes used during each run.

    python benchmarks/prepare_vs_torchrun.py                       # 3 rounds, 4 epochs of 1,024 images
    python benchmarks/prepare_vs_torchrun.py --rounds 1 --epochs 3 --images 256   # a quick look
    python benchmarks/prepare_vs_torchrun.py --dry-run              # the commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

# The script, as the user holds it. `PORTED` marks the lines of the ddpkit version; `TORCHRUN` those of the
# hand-written one; everything else is shared, so both sides do the same work.
SCRIPT = """\
import json, os, sys, time
import torch, torchvision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
PORTED = sys.argv[1] == "ported"
images, batch, epochs, workers = (int(a) for a in sys.argv[2:6])
if PORTED:
    import ddpkit
    device = ddpkit.init_distributed().device
    rank = ddpkit.get_rank()
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(images, 3, 32, 32, generator=g), torch.randint(0, 10, (images,), generator=g))
model = torchvision.models.resnet18(num_classes=10).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
criterion = nn.CrossEntropyLoss()
kw = {"num_workers": workers, "persistent_workers": workers > 0}
if PORTED:
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, **kw)
    model, optimizer, loader = ddpkit.prepare(model, optimizer, loader)
else:
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True, **kw)
    model = DDP(model)
for epoch in range(1, epochs + 1):
    if not PORTED:
        sampler.set_epoch(epoch)
    model.train()
    seen, t0 = 0, time.perf_counter()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        seen += len(y)
    (ddpkit.barrier() if PORTED else dist.barrier())
    seconds = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"epoch": epoch, "seconds": seconds, "images": seen * int(os.environ["WORLD_SIZE"])}),
              flush=True)
if not PORTED:
    dist.destroy_process_group()
"""

SIDES = ("torchrun", "ported", "unchanged")


def command(
    side: str, script: str, nproc: int, images: int, batch: int, epochs: int, workers: int
) -> list[str]:
    args = [str(images), str(batch), str(epochs), str(workers)]
    flag = f"--nproc-per-node={nproc}"
    if side == "torchrun":
        return [common.python(), "-m", "torch.distributed.run", flag, script, "torchrun", *args]
    return [
        common.python(),
        "-m",
        "ddpkit",
        "run",
        flag,
        script,
        "ported" if side == "ported" else "torchrun",
        *args,
    ]


def run_side(side: str, script: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = command(side, script, args.nproc, args.images, args.batch, args.epochs, args.workers)
    run = common.run_measured(cmd, side, env={"OMP_NUM_THREADS": "1"}, echo=args.echo)
    lines = run["lines"]
    rows = [json.loads(line) for _, line in lines if line.startswith('{"epoch"')]
    window = [r for r in rows if r["epoch"] >= 2]
    if len(rows) != args.epochs or not window:
        raise SystemExit(f"{side}: expected {args.epochs} epoch lines, got {len(rows)}")
    return {
        "side": side,
        "images_per_s": sum(r["images"] for r in window) / sum(r["seconds"] for r in window),
        **{k: run[k] for k in ("wall_s", "load1", "other_cores")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epoch 1 warms up; 2.. are timed")
    p.add_argument("--images", type=int, default=1024, help="training images (all ranks)")
    p.add_argument("--batch", type=int, default=64, help="per process")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process, every side")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--echo", action="store_true", help="show the runs' output")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (epoch 1 warms up)")
    with tempfile.TemporaryDirectory(prefix="ddpkit-prepare-bench-") as tmp:
        script = str(Path(tmp) / "train_resnet.py")
        Path(script).write_text(SCRIPT)
        if args.dry_run:
            for side in args.sides:
                print(
                    side
                    + ": "
                    + " ".join(
                        command(
                            side, "SCRIPT", args.nproc, args.images, args.batch, args.epochs, args.workers
                        )
                    )
                )
            return 0
        m = common.machine()
        print(f"prepare + ddpkit run vs torchrun: {common.machine_line(m)}", flush=True)
        runs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            order = args.sides if rnd % 2 == 0 else list(reversed(args.sides))
            for side in order:
                r = run_side(side, script, args)
                r["round"] = rnd + 1
                runs.append(r)
                print(
                    f"  round {rnd + 1} {side}: {r['images_per_s']:.1f} images/s, wall {r['wall_s']:.1f} s "
                    f"(load {r['load1']:.1f}, other {r['other_cores'] or 0:.2f} cores)",
                    flush=True,
                )
    med = {s: statistics.median(r["images_per_s"] for r in runs if r["side"] == s) for s in args.sides}
    wall = {s: statistics.median(r["wall_s"] for r in runs if r["side"] == s) for s in args.sides}
    base = med.get("torchrun")
    rows = []
    for s in args.sides:
        mine = [r for r in runs if r["side"] == s]
        rows.append(
            [
                s,
                f"{med[s]:.1f}",
                f"{med[s] / base:.3f}" if base else "-",
                f"{wall[s]:.1f}",
                " / ".join(f"{r['images_per_s']:.0f}" for r in mine),
                f"{min(r['load1'] for r in mine):.1f}-{max(r['load1'] for r in mine):.1f}",
                f"{max((r['other_cores'] or 0) for r in mine):.2f}",
            ]
        )
    print(f"\nMachine: {common.machine_line(m)}")
    print(
        "Command: python benchmarks/prepare_vs_torchrun.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
    )
    print()
    print(
        common.md_table(
            [
                "side",
                "images/s (median)",
                "/ torchrun",
                "wall s (median)",
                "rounds images/s",
                "load 1 min",
                "other cores (max)",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "runs": runs}, indent=1))
    if base and "ported" in med:
        ratio = med["ported"] / base
        print(f"\nported / torchrun {ratio:.3f} (target >= 0.97): {'PASS' if ratio >= 0.97 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
