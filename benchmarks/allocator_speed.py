"""The speed cost of the CPU workers' allocator setting (tensors above 1 MiB mapped and returned on free,
distributed/allocator.py): the same `ddpkit train` with it ("mapped": DDPKIT_MALLOC_TUNE=1) and without (glibc's
defaults), alternated (A B, B A, ...), each run's second epoch timed (metrics.jsonl's rate of epoch 2: the first
is the warm-up).

Two workloads on 2 processes, gloo, OMP_NUM_THREADS=1: torchvision resnet18 on synthetic 32x32 images at batch 64
(the workload of benchmarks/throughput_vs_plain_ddp.py), and a llama (4 blocks, width 512, 8 heads, context 128,
batch 8, AdamW) under dist.strategy=fsdp, whose gathered weights, gradients and activations are 1-8 MiB each.

    python benchmarks/allocator_speed.py                      # 3 rounds, 20 steps an epoch, both workloads
    python benchmarks/allocator_speed.py --rounds 5 --steps 30 --only llama
    python benchmarks/allocator_speed.py --threshold 4194304     # another threshold (MALLOC_MMAP_THRESHOLD_)
    python benchmarks/allocator_speed.py --lean --only llama      # dist.memory=lean against the default
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SIDES = ("mapped", "glibc")
LINES = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(10000))


def workload(name: str, steps: int, root: Path) -> tuple[list[str], str]:
    """(the `ddpkit train` keys of one run, the metrics field of its rate)."""
    if name == "resnet18":
        keys = [
            "data.dataset=synthetic",
            f"data.synthetic_size={steps * 64 * 2}",
            "data.synthetic_val_size=64",
        ]
        keys += ["data.image_size=32", "data.augment=false", "model.arch=resnet18", "model.num_classes=10"]
        keys += ["train.batch_size=64", *common.sgd_overrides(0.1, 0.9, 1e-4)]
        return keys, "train_images_per_s"
    text = root / "corpus.txt"
    block, batch = 128, 8
    text.write_text(LINES[: int(steps * batch * 2 * block * 1.12)])  # about `steps` steps an epoch on 2 ranks
    keys = ["model.arch=llama", "model.n_layer=4", "model.n_head=8", "model.n_embd=512", "data.dataset=text"]
    keys += [f"data.root={text}", f"data.block_size={block}", f"train.batch_size={batch}", "optim.name=adamw"]
    keys += ["optim.lr=0.001", "optim.ref_batch_size=null"]
    keys += ["dist.strategy=fsdp"]
    return keys, "train_tokens_per_s"


def run_side(
    side: str, name: str, steps: int, root: Path, echo: bool, threshold: int | None, lean: bool
) -> dict:
    keys, unit = workload(name, steps, root)
    keys += ["dist.memory=lean"] if lean and side == "mapped" else []
    out = Path(tempfile.mkdtemp(dir=root))
    cmd = [common.python(), "-m", "ddpkit", "train", *keys, "train.epochs=2", "eval.every=1000"]
    cmd += ["report.curves=false", "checkpoint.resume=none", "data.num_workers=0", f"out_dir={out}"]
    cmd += ["--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k != "DDPKIT_MALLOC_TUNE"}
    env["OMP_NUM_THREADS"] = "1"
    if side == "mapped" and lean:
        pass  # dist.memory=lean sets the same heap itself, once the model is sharded
    elif side == "mapped" and threshold is None:
        env["DDPKIT_MALLOC_TUNE"] = "1"
    elif side == "mapped":  # another threshold: glibc reads it at start
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    r = common.run_measured(cmd, f"{name} {side}", env=env, echo=echo)
    epochs = [row for row in common.read_jsonl(out / "metrics.jsonl") if row.get("epoch") == 2]
    return {**{k: r[k] for k in ("wall_s", "load1", "other_cores")}, unit: epochs[-1][unit]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps an epoch")
    p.add_argument("--only", nargs="+", choices=("resnet18", "llama"), default=["resnet18", "llama"])
    p.add_argument("--echo", action="store_true")
    p.add_argument("--threshold", type=int, help="the mapped side's threshold in bytes (default: ddpkit's)")
    p.add_argument("--lean", action="store_true", help="the mapped side is dist.memory=lean (llama only)")
    args = p.parse_args()
    print(
        f"allocator setting, mapped vs glibc's defaults: {common.machine_line(common.machine())}", flush=True
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            unit = workload(name, args.steps, Path(tmp))[1]
            runs = common.alternated(
                args.rounds, SIDES, lambda side, n=name: run_side(
                    side, n, args.steps, Path(tmp), args.echo, args.threshold, args.lean
                ),
                name, unit,
            )  # fmt: skip
            med, each, loads = common.compared(runs, SIDES, unit)
            rows.append(
                [name, f"{med['mapped']:.0f}", f"{med['glibc']:.0f}", f"{med['mapped'] / med['glibc']:.3f}"]
            )
            rows[-1] += [each, loads]
    head = ["workload", "mapped (rate/s)", "glibc defaults (rate/s)", "mapped / glibc", "each round", "load"]
    print(common.md_table(head, rows))


if __name__ == "__main__":
    main()
