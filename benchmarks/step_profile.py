"""Where a launch-bound step's time goes: ddpkit's Trainer and a hand-written loop, the same work, in one process.

Both train the built-in CNN on the in-memory digits (or the MLP on synthetic images; batch 64, no augmentation,
SGD, constant lr, OMP_NUM_THREADS=1) for --epochs epochs, alternately --rounds times, and report the median CPU
time of this process per optimizer step of each (CPU time, not wall time: on a machine shared with other work it
still counts only what each side does); with --profile, cProfile's top functions (by own time) of one more epoch of each,
what ddpkit calls per step that the loop does not.

    OMP_NUM_THREADS=1 python benchmarks/step_profile.py                      # digits, 3 rounds
    OMP_NUM_THREADS=1 python benchmarks/step_profile.py --net mlp --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_bound import LR, MOMENTUM, SEED, WEIGHT_DECAY, data_overrides  # noqa: E402

RESNET_SIZE = 512  # resnet18 on 32x32 synthetic images: 8 steps of 64 an epoch


def net_overrides(net: str) -> list[str]:
    """launch_bound's data and net keys; resnet18 on its synthetic images (the overhead benchmark's work)."""
    if net != "resnet18":
        return data_overrides(net, 0)
    keys = [o for o in data_overrides("mlp", 0) if not o.startswith(("model.arch=", "data.synthetic_size="))]
    return [*keys, "model.arch=resnet18", f"data.synthetic_size={RESNET_SIZE}"]


def trainer_epochs(out_dir: str, net: str, batch: int, epochs: int):
    """A 1-process Trainer, and a function that trains `epochs` more epochs of it (returns steps, seconds)."""
    from ddpkit.config import load_config
    from ddpkit.distributed.runtime import init_distributed
    from ddpkit.train.trainer import Trainer

    overrides = [
        *net_overrides(net),
        f"out_dir={out_dir}",
        f"train.batch_size={batch}",
        "train.epochs=1000",
        f"optim.lr={LR}",
        f"optim.momentum={MOMENTUM}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.ref_batch_size=null",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
    ]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, init_distributed(cfg.dist))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    trainer.log.open()

    def run(n: int) -> tuple[int, float]:
        t0, step0 = time.process_time(), trainer.state.step
        for _ in range(n):
            trainer.train_epoch(trainer.state.epoch + 1)
        return trainer.state.step - step0, time.process_time() - t0

    return trainer, run


def loop_epochs(trainer, batch: int):
    """The hand-written loop over the trainer's own data, a fresh copy of its net: a function of epochs."""
    import copy

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = zip(*(trainer.train_set[i] for i in range(len(trainer.train_set))), strict=True)
    loader = DataLoader(
        TensorDataset(torch.stack(xs), torch.tensor(ys)), batch_size=batch, shuffle=True, drop_last=True
    )
    torch.manual_seed(SEED)
    model = copy.deepcopy(trainer.model)
    opt = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY
    )
    criterion = torch.nn.CrossEntropyLoss()

    def run(n: int) -> tuple[int, float]:
        t0, steps = time.process_time(), 0
        for _ in range(n):
            model.train()
            sums = torch.zeros(3, dtype=torch.float64)
            for x, y in loader:
                logits = model(x)
                loss = criterion(logits, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                nb = torch.tensor(float(y.shape[0]), dtype=torch.float64)
                sums += torch.stack([loss.detach().double() * nb, (logits.argmax(1) == y).sum().double(), nb])
                steps += 1
            sums.tolist()
        return steps, time.process_time() - t0

    return run


def profiled(run, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    steps, _ = run(1)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(top)
    return f"({steps} steps)\n" + out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--net", choices=("digits", "mlp", "resnet18"), default="digits")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3, help="epochs per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions of each side")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory(prefix="ddpkit-profile-") as tmp:
        trainer, ddpkit_run = trainer_epochs(str(Path(tmp) / "run"), args.net, args.batch, args.epochs)
        plain_run = loop_epochs(trainer, args.batch)
        ddpkit_run(1), plain_run(1)  # warm-up
        per_step: dict[str, list[float]] = {"ddpkit": [], "plain": []}
        for rnd in range(args.rounds):
            order = (("ddpkit", ddpkit_run), ("plain", plain_run))
            for side, run in order if rnd % 2 == 0 else order[::-1]:
                steps, seconds = run(args.epochs)
                per_step[side].append(1e3 * seconds / steps)
        load = os.getloadavg()[0]
        med = {s: statistics.median(v) for s, v in per_step.items()}
        print(f"{args.net} batch {args.batch}, 1 process, load average {load:.1f}")
        for side in ("ddpkit", "plain"):
            rounds = ", ".join(f"{v:.3f}" for v in per_step[side])
            print(f"  {side}: median {med[side]:.3f} CPU ms/step (rounds {rounds})")
        print(f"  ddpkit / plain speed: {med['plain'] / med['ddpkit']:.3f}")
        if args.profile:
            for side, run in (("ddpkit", ddpkit_run), ("plain", plain_run)):
                print(f"\n== {side} " + profiled(run, args.top))
        trainer.log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
