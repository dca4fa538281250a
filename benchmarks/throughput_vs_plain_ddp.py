"""Training throughput: `ddpkit train` vs a plain hand-written DDP loop doing the same work, side by side.

The work, on both sides: torchvision resnet18 with 10 classes, synthetic 32x32 RGB images (ddpkit's own
`data.dataset=synthetic`, so the samples are the same), batch 64 per process, 2 processes on gloo, SGD
(lr 0.1, momentum 0.9, Nesterov, weight decay 1e-4, constant lr), no augmentation, data.num_workers 0,
OMP_NUM_THREADS=1, 3 epochs of STEPS optimizer steps each.

  ddpkit  python -m ddpkit train data.dataset=synthetic model.arch=resnet18 ... --nproc-per-node 2
  plain   python -m torch.distributed.run --standalone --nproc-per-node 2 THIS_FILE --worker ...
          (init_process_group, DDP, DistributedSampler, its own loop; the data set is generated into
          memory first, with ddpkit.data.build_datasets and the same Config keys)

What is timed, the same way on both sides: the SECOND epoch (the first one is the warm-up: allocator, gloo
buffers, first-touch of the weights), from before the epoch's set-up (set_epoch, iterator) to after the
epoch's metric all-reduce; images/s = global images of that epoch / its time. For ddpkit this is
metrics.jsonl's `epoch_time_s` and `train_images_per_s` of epoch 2: ddpkit's metrics only give whole epochs,
so whole epochs are timed on both sides. ddpkit's `epoch_time_s` holds the epoch's evaluation too, and ddpkit
evaluates after the last epoch whatever eval.every says: so both sides run 3 epochs and the middle one, which
neither evaluates, is timed (until 2026-11-29 the timed epoch 2 was the last, and ddpkit's evaluation of the 128
validation images fell inside its window). ddpkit's checkpoints are written after the epoch's timer stops; the
plain loop writes none.

The two run alternately (A B, B A, A B, ...), REPS times each; the report gives each run, the medians, the
ratio of the medians ddpkit/plain (target >= 0.97) and the CPU time other processes used during each run
(other load: the machine is shared; a run with much of it is noisy).

    python benchmarks/throughput_vs_plain_ddp.py                 # 3 repetitions, 30 steps per epoch
    python benchmarks/throughput_vs_plain_ddp.py --reps 5 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    busy_s,
    machine,
    machine_line,
    md_table,
    python,
    read_jsonl,
    run_measured,
    sgd_overrides,
)

SEED = 0
LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4
VAL_SIZE = 128  # ddpkit evaluates after the last epoch (outside the timed window); keep it short


def data_overrides(steps: int, batch: int, nproc: int) -> list[str]:
    """The Config keys that define the data, shared by both sides."""
    return [
        "data.dataset=synthetic",
        f"data.synthetic_size={steps * batch * nproc}",
        f"data.synthetic_val_size={VAL_SIZE}",
        "data.image_size=32",
        "data.augment=false",
        "data.num_workers=0",
        "model.num_classes=10",
        f"seed={SEED}",
        "train.label_smoothing=0",  # the plain loop's plain cross-entropy
    ]


def ddpkit_command(steps: int, batch: int, nproc: int, out_dir: str) -> list[str]:
    return [
        python(),
        "-m",
        "ddpkit",
        "train",
        *data_overrides(steps, batch, nproc),
        "model.arch=resnet18",
        f"train.batch_size={batch}",
        "train.epochs=3",
        *sgd_overrides(LR, MOMENTUM, WEIGHT_DECAY),
        "eval.every=1000",
        "checkpoint.resume=none",
        f"out_dir={out_dir}",
        "--nproc-per-node",
        str(nproc),
    ]


def plain_command(steps: int, batch: int, nproc: int, out_json: str) -> list[str]:
    return [
        python(),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(Path(__file__).resolve()),
        "--worker",
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--world",
        str(nproc),
        "--out",
        out_json,
    ]


# ------------------------------------------------------------------------------------------------------
# the plain DDP loop (what the tutorials write by hand), run by torch.distributed.run
# ------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from ddpkit.config import load_config
    from ddpkit.data import build_datasets

    on_gpu = args.device == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same samples ddpkit trains on, generated into memory before training.
    cfg = load_config(None, data_overrides(args.steps, args.batch, args.world))
    train_set, _, _ = build_datasets(cfg)
    xs, ys = zip(*(train_set[i] for i in range(len(train_set))), strict=True)
    dataset = TensorDataset(torch.stack(xs), torch.tensor(ys))

    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=on_gpu,
        persistent_workers=args.workers > 0,
    )
    torch.manual_seed(SEED)
    net = torchvision.models.resnet18(num_classes=10).to(dev)
    model = DDP(net, device_ids=[dev.index] if on_gpu else None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY
    )
    criterion = nn.CrossEntropyLoss()

    epochs = []
    for epoch in (1, 2, 3):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss sum, correct, count: one all-reduce
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            logits = model(x)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sums += torch.stack(
                [
                    loss.detach().double() * y.shape[0],
                    (logits.argmax(1) == y).sum().double(),
                    torch.tensor(float(y.shape[0]), dtype=torch.float64, device=dev),
                ]
            )
        dist.all_reduce(sums)
        loss_sum, correct, count = sums.tolist()  # waits for the device
        elapsed = time.perf_counter() - t0
        epochs.append(
            {
                "epoch": epoch,
                "steps": len(loader),
                "images": int(count),
                "epoch_time_s": elapsed,
                "train_images_per_s": count / elapsed,
                "train_loss": loss_sum / count,
                "train_acc1": correct / count,
            }
        )
        if rank == 0:
            print(
                f"plain epoch {epoch}: {count / elapsed:.1f} img/s, {elapsed:.2f} s, loss {loss_sum / count:.4f}",
                flush=True,
            )
    if rank == 0:
        Path(args.out).write_text(json.dumps(epochs))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------


def wait_quiet(max_wait_s: float, threshold_cores: float = 0.3) -> float:
    """Wait (at most max_wait_s) until other processes use less than threshold_cores; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        b0 = busy_s()
        if b0 is None:
            return 0.0
        time.sleep(1.0)
        if busy_s() - b0 < threshold_cores:
            break
    return time.perf_counter() - t0


def run_side(
    side: str, steps: int, batch: int, nproc: int, echo: bool, device: str = "cpu", workers: int = 0
) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-bench-{side}-") as tmp:
        out = str(Path(tmp) / ("run" if side == "ddpkit" else "plain.json"))
        cmd = (
            [
                *ddpkit_command(steps, batch, nproc, out),
                f"dist.device={device}",
                f"data.num_workers={workers}",
            ]
            if side == "ddpkit"
            else [*plain_command(steps, batch, nproc, out), "--device", device, "--workers", str(workers)]
        )
        run = run_measured(cmd, f"{side} run", env=env, echo=echo)
        rows = (
            read_jsonl(Path(out) / "metrics.jsonl") if side == "ddpkit" else json.loads(Path(out).read_text())
        )
    by_epoch = {int(r["epoch"]): r for r in rows}
    e2 = by_epoch[2]
    images = round(e2["train_images_per_s"] * e2["epoch_time_s"])
    return {
        "side": side,
        "images_per_s": e2["train_images_per_s"] * e2["epoch_time_s"] / e2["epoch_time_s"],
        "epoch2_time_s": e2["epoch_time_s"],
        "epoch2_images": images,
        "epoch1_images_per_s": by_epoch[1]["train_images_per_s"],
        "epoch2_train_loss": e2["train_loss"],
        "wall_s": run["wall_s"],
        "other_load_cores": run["other_cores"],
        "command": " ".join(cmd[1:]),
    }


def report(
    runs: list[dict[str, Any]], m: dict[str, Any], args: argparse.Namespace, argv: list[str]
) -> tuple[str, float]:
    lines = [
        f"Machine: {machine_line(m)}",
        f"Command: python benchmarks/throughput_vs_plain_ddp.py {' '.join(argv)}".rstrip(),
        f"Work: resnet18 (10 classes), synthetic 3x32x32, batch {args.batch} per process x {args.nproc} processes "
        f"({'nccl, one GPU each' if args.device == 'cuda' else 'gloo'}), "
        f"SGD, {args.steps} steps per epoch, 3 epochs; timed: epoch 2 ({args.steps} steps, "
        f"{args.steps * args.batch * args.nproc} images). OMP_NUM_THREADS=1, num_workers {args.workers}, no augmentation.",
        "",
    ]
    rows = []
    for i, r in enumerate(runs):
        rows.append(
            [
                i + 1,
                r["side"],
                f"{r['images_per_s']:.1f}",
                f"{r['epoch2_time_s']:.2f}",
                f"{r['epoch1_images_per_s']:.1f}",
                f"{r['epoch2_train_loss']:.4f}",
                f"{r['wall_s']:.1f}",
                "-" if r["other_load_cores"] is None else f"{r['other_load_cores']:.2f}",
            ]
        )
    lines.append(
        md_table(
            [
                "run",
                "side",
                "images/s (epoch 2)",
                "epoch 2 time s",
                "epoch 1 images/s (warm-up)",
                "epoch 2 train loss",
                "wall s",
                "other load (cores)",
            ],
            rows,
        )
    )
    med = {
        s: statistics.median(r["images_per_s"] for r in runs if r["side"] == s) for s in ("ddpkit", "plain")
    }
    ratio = med["ddpkit"] / med["plain"]
    best = {s: max(r["images_per_s"] for r in runs if r["side"] == s) for s in ("ddpkit", "plain")}
    lines += [
        "",
        md_table(
            ["", "ddpkit train", "plain DDP", "ddpkit / plain"],
            [
                ["median images/s", f"{med['ddpkit']:.1f}", f"{med['plain']:.1f}", f"**{ratio:.3f}**"],
                [
                    "best images/s",
                    f"{best['ddpkit']:.1f}",
                    f"{best['plain']:.1f}",
                    f"{best['ddpkit'] / best['plain']:.3f}",
                ],
            ],
        ),
        "",
        f"ratio of medians ddpkit/plain = {ratio:.3f} (target >= 0.97): {'PASS' if ratio >= 0.97 else 'FAIL'}",
    ]
    return "\n".join(lines), ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="runs of each side (alternating)")
    p.add_argument(
        "--steps", type=int, default=30, help="optimizer steps per epoch (3 epochs; the second is timed)"
    )
    p.add_argument("--batch", type=int, default=64, help="per process")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process, both sides")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per process, nccl")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        metavar="S",
        help="before each run wait up to S seconds for other processes to go quiet (0: never)",
    )
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--echo", action="store_true", help="show the runs' output")
    p.add_argument("--dry-run", action="store_true", help="print the two commands, run nothing")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument(
        "--world", type=int, help=argparse.SUPPRESS
    )  # --nproc would clash with torch.distributed.run's flags
    raw = sys.argv[1:] if argv is None else argv
    args = p.parse_args(raw)
    if args.worker:
        worker(args)
        return 0
    if args.dry_run:
        device = [f"dist.device={args.device}", f"data.num_workers={args.workers}"]
        print("ddpkit:", " ".join([*ddpkit_command(args.steps, args.batch, args.nproc, "OUT"), *device]))
        plain = plain_command(args.steps, args.batch, args.nproc, "OUT")
        print("plain:", " ".join([*plain, "--device", args.device, "--workers", str(args.workers)]))
        return 0
    m = machine()
    print(f"throughput ddpkit train vs plain DDP: {machine_line(m)}", flush=True)
    runs = []
    for rep in range(args.reps):
        order = ("ddpkit", "plain") if rep % 2 == 0 else ("plain", "ddpkit")
        for side in order:
            waited = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
            print(
                f"  rep {rep + 1}/{args.reps}: {side} ..."
                + (f" (waited {waited:.0f} s for a quiet machine)" if waited > 2 else ""),
                flush=True,
            )
            r = run_side(side, args.steps, args.batch, args.nproc, args.echo, args.device, args.workers)
            r["rep"] = rep + 1
            load = "" if r["other_load_cores"] is None else f", other load {r['other_load_cores']:.2f} cores"
            print(
                f"    {r['images_per_s']:.1f} images/s (epoch 2: {r['epoch2_time_s']:.2f} s), wall {r['wall_s']:.1f} s{load}",
                flush=True,
            )
            runs.append(r)
    text, ratio = report(runs, m, args, raw)
    print()
    print(text)
    print()
    print("Commands (OMP_NUM_THREADS=1; TMP is a temporary folder):")
    for side in ("ddpkit", "plain"):
        cmd = next(r["command"] for r in runs if r["side"] == side)
        print(f"  {side}: python {_tmp(cmd)}")
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "runs": runs, "ratio": ratio}, indent=1))
        print(f"raw results: {args.json}")
    return 0


def _tmp(cmd: str) -> str:
    import re

    return re.sub(r"\S*ddpkit-bench-\S+", "TMP", cmd)


if __name__ == "__main__":
    raise SystemExit(main())
