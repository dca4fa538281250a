"""Launch-bound training: `ddpkit train` against a careful hand-written loop where a step costs milliseconds.

Every fixed cost per step or per epoch shows when the model's own work is small. Two works, on both sides:

  digits  the built-in CNN (ddpkit.models.small.model.SmallCNN) on the 1,438 in-memory 8x8 digits (no augmentation)
  mlp     the built-in MLP (3x32x32 -> 256 -> 128 -> 10) on ddpkit's synthetic images (in memory)

at batch 64 and 256 per process, 1 and 2 processes (gloo), data.num_workers 0 and 2 (4 on a GPU), SGD (lr 0.1,
momentum 0.9, Nesterov, weight decay 5e-4, constant lr), OMP_NUM_THREADS=1.

  ddpkit  python -m ddpkit train data.dataset=... model.arch=... optim.schedule=constant ... [--nproc-per-node 2]
  plain   python THIS_FILE --worker ...  (2 processes: under torch.distributed.run): the data set built once into
          tensors (a TensorDataset), a plain DataLoader (DistributedSampler with 2 processes, persistent_workers
          with workers), DDP with 2 processes, SGD, the loss/accuracy sums kept on the device and all-reduced once
          an epoch: what a careful user writes

What is timed, the same way on both sides: epochs 2 .. E-1 (epoch 1 warms up; ddpkit evaluates after the last),
each from before its set-up to after its metric all-reduce (ddpkit: metrics.jsonl's epoch_time_s); images/s =
their images / the sum of their times. Checkpoints and metrics lines are written outside that window. The sides
run alternately (A B, B A, ...) per setting; the report gives the medians, their ratio ddpkit/plain (target
>= 0.97), the load average before each run and the CPU other processes used during it.

    python benchmarks/launch_bound.py                                  # every setting, 3 rounds
    python benchmarks/launch_bound.py --nets digits --batches 64 --nprocs 2 --workers 0 2 --rounds 3
    python benchmarks/launch_bound.py --device cuda --nprocs 1 --workers 0 4   # on one GPU
    python benchmarks/launch_bound.py --dry-run                        # the commands, nothing run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SEED = 0
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
MLP_SIZE = 8192  # synthetic training images
VAL_SIZE = 256


def data_overrides(net: str, workers: int) -> list[str]:
    """The Config keys that define the data (and the net), shared by both sides."""
    shared = ["data.augment=false", f"data.num_workers={workers}", f"seed={SEED}", "train.label_smoothing=0"]
    if net == "digits":
        return ["data.dataset=digits", "model.arch=cnn", *shared]
    return [
        "data.dataset=synthetic",
        f"data.synthetic_size={MLP_SIZE}",
        f"data.synthetic_val_size={VAL_SIZE}",
        "data.image_size=32",
        "model.num_classes=10",
        "model.arch=mlp",
        *shared,
    ]


def ddpkit_command(net: str, batch: int, nproc: int, workers: int, epochs: int, device: str, out: str):
    return [
        common.python(),
        "-m",
        "ddpkit",
        "train",
        *data_overrides(net, workers),
        f"train.batch_size={batch}",
        f"train.epochs={epochs}",
        *common.sgd_overrides(LR, MOMENTUM, WEIGHT_DECAY),
        "eval.every=1000",
        "report.curves=false",
        "checkpoint.resume=none",
        f"dist.device={device}",
        f"out_dir={out}",
        *(["--nproc-per-node", str(nproc)] if nproc > 1 else []),
    ]


def plain_command(net: str, batch: int, nproc: int, workers: int, epochs: int, device: str, out: str):
    launch = (
        [common.python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if nproc > 1
        else [common.python()]
    )
    return [
        *launch,
        str(Path(__file__).resolve()),
        "--worker",
        *("--nets", net, "--batches", str(batch), "--workers", str(workers)),
        *("--epochs", str(epochs), "--device", device, "--out", out),
    ]


# ------------------------------------------------------------------------------------------------------
# the hand-written loop
# ------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from ddpkit.config import load_config
    from ddpkit.data import build_datasets
    from ddpkit.models.small.model import SmallCNN, build_mlp

    net, batch, workers = args.nets[0], args.batches[0], args.workers[0]
    distributed = "WORLD_SIZE" in os.environ
    on_gpu = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    if distributed:
        dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank() if distributed else 0

    # The samples ddpkit trains on, into memory once (a user's own tensors).
    train_set, _, spec = build_datasets(load_config(None, data_overrides(net, workers)))
    xs, ys = zip(*(train_set[i] for i in range(len(train_set))), strict=True)
    dataset = TensorDataset(torch.stack(xs), torch.tensor(ys))
    # One loop for one process and many: a DistributedSampler over this process group's size (1 without one).
    # Its order is ddpkit's too (randperm seeded with seed + epoch), so both sides take the same steps: the
    # same arithmetic, also where a trajectory runs into subnormal floats (slow on many CPUs).
    world = dist.get_world_size() if distributed else 1
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        pin_memory=on_gpu,
        persistent_workers=workers > 0,
    )
    torch.manual_seed(SEED)
    model: nn.Module = (
        SmallCNN(10, spec.in_channels, spec.image_size)
        if net == "digits"
        else build_mlp(10, spec.in_channels, spec.image_size)
    ).to(dev)
    if distributed:
        model = DDP(model, device_ids=[dev.index] if on_gpu else None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY
    )
    criterion = nn.CrossEntropyLoss()
    rows = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # loss sum, correct, count
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            logits = model(x)
            loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            n = torch.tensor(float(y.shape[0]), dtype=torch.float64, device=dev)
            sums += torch.stack([loss.detach().double() * n, (logits.argmax(1) == y).sum().double(), n])
        if distributed:
            dist.all_reduce(sums)
        loss_sum, correct, count = sums.tolist()  # waits for the device
        elapsed = time.perf_counter() - t0
        rows.append(
            {"epoch": epoch, "epoch_time_s": elapsed, "images": count, "train_loss": loss_sum / count}
        )
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    if distributed:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------


def timed(rows: list[dict[str, Any]], epochs: int) -> tuple[float, float]:
    """(images, seconds) of epochs 2 .. epochs-1."""
    window = [r for r in rows if 2 <= int(r["epoch"]) <= epochs - 1]
    images = sum(
        r["images"] if "images" in r else r["train_images_per_s"] * r["epoch_time_s"] for r in window
    )
    return images, sum(r["epoch_time_s"] for r in window)


def run_side(side: str, setting: tuple, epochs: int, device: str, echo: bool) -> dict[str, Any]:
    """One run of one side; a run that fails is run once more, and the failure is kept in the result."""
    net, batch, nproc, workers = setting

    def attempt() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix=f"ddpkit-launch-{side}-") as tmp:
            out = str(Path(tmp) / ("run" if side == "ddpkit" else "plain.json"))
            build = ddpkit_command if side == "ddpkit" else plain_command
            cmd = build(net, batch, nproc, workers, epochs, device, out)
            run = common.run_measured(cmd, f"{side} {setting}", env={"OMP_NUM_THREADS": "1"}, echo=echo)
            rows = (
                common.read_jsonl(Path(out) / "metrics.jsonl")
                if side == "ddpkit"
                else json.loads(Path(out).read_text())
            )
        images, seconds = timed(rows, epochs)
        return {
            "side": side,
            "images_per_s": images / seconds,
            "final_train_loss": rows[-1]["train_loss"],
            **{k: run[k] for k in ("load1", "other_cores", "wall_s")},
        }

    result, failures = common.once_more_on_failure(attempt, f"{side} {setting}")
    return {**result, "failed_first": failures}


def settings(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    return list(itertools.product(args.nets, args.batches, args.nprocs, args.workers))


def commands(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """Every command a run would start (one per side and setting), with OUT for its output path."""
    out = []
    for net, batch, nproc, workers in settings(args):
        for side, build in (("ddpkit", ddpkit_command), ("plain", plain_command)):
            out.append((side, build(net, batch, nproc, workers, args.epochs, args.device, "OUT")))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nets", nargs="+", choices=("digits", "mlp"), default=["digits", "mlp"])
    p.add_argument("--batches", nargs="+", type=int, default=[64, 256], help="per process")
    p.add_argument("--nprocs", nargs="+", type=int, default=[1, 2])
    p.add_argument("--workers", nargs="+", type=int, default=[0, 2], help="DataLoader workers per process")
    p.add_argument("--rounds", type=int, default=3, help="alternated runs of each side per setting")
    p.add_argument("--epochs", type=int, default=6, help="epochs per run (2 .. E-1 are timed)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    common.add_run_options(p)
    args, raw = common.parse_run_args(p, argv)
    if args.worker:
        worker(args)
        return 0
    if args.dry_run:
        for side, cmd in commands(args):
            print(f"{side}: OMP_NUM_THREADS=1 {' '.join(cmd)}")
        return 0
    m = common.machine()
    print(f"launch-bound ddpkit train vs a hand-written loop: {common.machine_line(m)}", flush=True)
    table, raw_runs, ratios = [], [], []
    for setting in settings(args):
        sides = ("ddpkit", "plain")
        runs = common.alternated(
            args.rounds,
            sides,
            lambda side, setting=setting: run_side(side, setting, args.epochs, args.device, args.echo),
            str(setting),
            "images_per_s",
        )
        med, each, loads = common.compared(runs, sides, "images_per_s")
        ratio = med["ddpkit"] / med["plain"]
        ratios.append(ratio)
        losses = {r["side"]: r["final_train_loss"] for r in runs}
        print(
            f"{setting}: last epoch's train loss ddpkit {losses['ddpkit']:.6g}, plain {losses['plain']:.6g}"
        )
        table.append(
            [*setting, f"{med['ddpkit']:.0f}", f"{med['plain']:.0f}", f"**{ratio:.3f}**", each, loads]
        )
        raw_runs.append({"setting": setting, "runs": runs, "ratio": ratio})
    headers = ["net", "batch/process", "processes", "workers", "ddpkit images/s (median)"]
    headers += ["plain images/s (median)", "ddpkit / plain", "rounds (ddpkit / plain)", "load average 1 min"]
    verdict = "PASS" if min(ratios) >= 0.97 else "FAIL"
    common.report(
        m,
        f"benchmarks/launch_bound.py {' '.join(raw)}",
        headers,
        table,
        f"lowest ratio {min(ratios):.3f} (target >= 0.97 at every setting): {verdict}",
        args.json,
        {"settings": raw_runs},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
