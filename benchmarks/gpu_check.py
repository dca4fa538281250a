"""The GPU paths in one call: NCCL, AMP (bf16, fp16), channels_last, compile, FSDP2/ZeRO-2, offload and
activation checkpointing on one CUDA device, each through the real `ddpkit` commands.

    python benchmarks/gpu_check.py --out DIR        # about 5 minutes on one H100/H200

Every case is a subprocess of `python -m ddpkit ...`; the script reads each run's metrics.jsonl and prints one
table (case, exit code, wall seconds, final validation figure, training throughput). With one GPU, multi-rank
NCCL layouts (tp, pp, dp > 1) cannot run (NCCL refuses two ranks on one device); the case
`two_ranks_one_gpu` checks that ddpkit says so in one line before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import read_jsonl  # noqa: E402

DIGITS = ["train.epochs=15", "seed=0"]
RESNET = [
    "data.dataset=synthetic",
    "model.arch=resnet18",
    "data.synthetic_size=8192",
    "data.synthetic_val_size=1024",
    "train.epochs=2",
    "train.batch_size=256",
    "data.augment=false",
    "data.num_workers=4",
]
GPT = ["-c", "configs/text_gpt.yaml", "train.max_steps=200", "train.log_every=100"]

CASES: list[tuple[str, list[str]]] = [
    ("digits_fp32", ["train", *DIGITS]),
    ("digits_bf16", ["train", *DIGITS, "train.amp=bf16"]),
    ("digits_fp16", ["train", *DIGITS, "train.amp=fp16"]),
    ("digits_channels_last", ["train", *DIGITS, "model.channels_last=true"]),
    ("digits_compile", ["train", *DIGITS, "model.compile=true"]),
    ("resnet18_fp32", ["train", *RESNET]),
    ("resnet18_bf16_cl", ["train", *RESNET, "train.amp=bf16", "model.channels_last=true"]),
    ("gpt_single", ["train", *GPT, "dist.strategy=single"]),
    ("gpt_fsdp_nccl", ["train", *GPT, "dist.strategy=fsdp", "--nproc-per-node", "1"]),
    ("gpt_zero2_nccl", ["train", *GPT, "dist.strategy=zero2", "--nproc-per-node", "1"]),
    ("gpt_fsdp_offload", ["train", *GPT, "dist.strategy=fsdp", "dist.offload=cpu", "--nproc-per-node", "1"]),
    ("gpt_actckpt_bf16", ["train", *GPT, "model.activation_checkpointing=full", "train.amp=bf16"]),
    ("gpt_ddp_nccl_1", ["train", *GPT, "dist.strategy=ddp", "--nproc-per-node", "1"]),
    ("two_ranks_one_gpu", ["train", *DIGITS, "--nproc-per-node", "2"]),
]


def last_metrics(run: Path) -> dict:
    out: dict = {}
    for row in read_jsonl(run / "metrics.jsonl"):
        out.update({k: v for k, v in row.items() if v is not None})
    return out


def run_case(name: str, args: list[str], root: Path, timeout: float) -> dict:
    run = root / name
    cmd = [sys.executable, "-m", "ddpkit", *args]
    if args[0] == "train":
        cmd.append(f"out_dir={run}")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", str(e.stderr or "")
    wall = time.perf_counter() - t0
    (root / f"{name}.log").write_text(f"$ {' '.join(cmd)}\nrc={rc}\n{err}")
    res = {"case": name, "rc": rc, "wall_s": round(wall, 1), "stderr_tail": err.strip().splitlines()[-3:]}
    if (run / "metrics.jsonl").is_file():
        m = last_metrics(run)
        keys = ("val_acc1", "val_loss", "train_images_per_s", "train_tokens_per_s", "epoch_time_s")
        res.update({k: m[k] for k in keys if k in m})
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*", help="case names (default all)")
    p.add_argument("--timeout", type=float, default=90)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(json.dumps(info), flush=True)
    results = [info]
    t0 = time.perf_counter()
    comm = [
        sys.executable,
        "-m",
        "ddpkit",
        "comm",
        "--nproc-per-node",
        "1",
        "--json",
        str(args.out / "comm.json"),
    ]
    p = subprocess.run(comm, capture_output=True, text=True, timeout=180)
    (args.out / "comm.log").write_text(p.stdout + p.stderr)
    results.append({"case": "comm_nccl", "rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1)})
    print(p.stdout[-3000:], p.stderr[-1500:], flush=True)
    for name, cargs in CASES:
        if args.only and name not in args.only:
            continue
        res = run_case(name, cargs, args.out / "runs", args.timeout)
        results.append(res)
        print(json.dumps(res), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
