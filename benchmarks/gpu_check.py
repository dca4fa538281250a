"""The GPU paths in one call: NCCL, AMP (bf16, fp16), channels_last, compile, FSDP2/ZeRO-2, offload and
activation checkpointing on one CUDA device, each through the real `ddpkit` commands; then throughput against
hand-written loops: the launch-bound comparison (launch_bound.py, workers 0 and 4), resnet18 32x32 batch 256
against a plain DDP loop (throughput_vs_plain_ddp.py, workers 0 and 4, as RESULTS section 12) and ResNet-50
224x224 bf16 + channels_last on synthetic images (images/s).

    python benchmarks/gpu_check.py --out DIR        # about 14 minutes on one H100 (more than one 10-minute call:
                                                    # split it with --parts, e.g. comparisons, then comm paths)
    python benchmarks/gpu_check.py --out DIR --dry-run   # the commands it would run, nothing run (any machine)
    python benchmarks/gpu_check.py --out DIR --parts paths resnet50
    python benchmarks/gpu_check.py --out DIR --parts workers   # the loader-workers gap (RESULTS 12b), ~2 minutes
    python benchmarks/gpu_check.py --out DIR --parts llama1b   # a 1B llama, fsdp + bf16, compile off/on, ~6 minutes

`llama1b`: a llama of 1.01B parameters (20 blocks, width 2048, context 2048, batch 8) built on the meta device,
bf16 by FSDP2's MixedPrecisionPolicy, under `ddpkit train dist.strategy=fsdp` on one GPU with model.compile off
and on (tokens/s, MFU and peak memory of epoch 2 of 3: epoch 1 holds the compile, the last the evaluation), beside
the same model in a hand-written FSDP2 loop (llama_fsdp_gpu.py, compile off and on).

Every case is a subprocess; the script reads each run's metrics.jsonl (the comparisons: their own tables) and
prints one table at the end (case, exit code, wall seconds, final validation figure, training throughput, ratio
to the hand-written loop). With one GPU, multi-rank NCCL layouts (tp, pp, dp > 1) cannot run (NCCL refuses two
ranks on one device); the case `two_ranks_one_gpu` checks that ddpkit says so in one line before any worker
starts.
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
from _common import md_table, read_jsonl  # noqa: E402

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
    ("resnet18_w4_nopin", ["train", *RESNET, "data.pin_memory=false"]),
    ("resnet18_w0", ["train", *RESNET, "data.num_workers=0"]),
    ("gpt_single", ["train", *GPT, "dist.strategy=single"]),
    ("llama_single", ["train", *GPT, "model.arch=llama", "dist.strategy=single"]),
    ("gpt_fsdp_nccl", ["train", *GPT, "dist.strategy=fsdp", "--nproc-per-node", "1"]),
    ("gpt_zero2_nccl", ["train", *GPT, "dist.strategy=zero2", "--nproc-per-node", "1"]),
    ("gpt_fsdp_offload", ["train", *GPT, "dist.strategy=fsdp", "dist.offload=cpu", "--nproc-per-node", "1"]),
    ("gpt_actckpt_bf16", ["train", *GPT, "model.activation_checkpointing=full", "train.amp=bf16"]),
    ("gpt_ddp_nccl_1", ["train", *GPT, "dist.strategy=ddp", "--nproc-per-node", "1"]),
    ("two_ranks_one_gpu", ["train", *DIGITS, "--nproc-per-node", "2"]),
]

# ResNet-50 at 224x224, bf16 + channels_last, on synthetic images made once (1,536 of them fit the made-once
# budget): images/s of the model, not of the generator
RESNET50 = [
    "data.dataset=synthetic",
    "model.arch=resnet50",
    "data.image_size=224",
    "data.synthetic_size=1536",
    "data.synthetic_val_size=128",
    "data.augment=false",
    "data.num_workers=4",
    "train.batch_size=128",
    "train.epochs=3",
    "train.amp=bf16",
    "model.channels_last=true",
]
CASES.append(("resnet50_224_bf16_cl", ["train", *RESNET50]))

# The loader-workers gap on CUDA (RESULTS section 12b: resnet18 with 4 workers at 0.28x the plain loop, with none at
# 1.43x): the slow run of throughput_vs_plain_ddp.py's ddpkit side (25,600 images, one launched process, one thread)
# against the same with 4 threads, without pinned memory, and without workers; each case's environment beside it.
SLOW_W4 = [
    *RESNET[:2],
    "data.synthetic_size=25600",
    "data.synthetic_val_size=128",
    "train.epochs=2",
    "train.batch_size=256",
    "data.augment=false",
    "dist.device=cuda",
    "--nproc-per-node",
    "1",
]
WORKERS: list[tuple[str, dict[str, str], list[str]]] = [
    ("w4_omp1", {"OMP_NUM_THREADS": "1"}, ["train", *SLOW_W4, "data.num_workers=4"]),
    ("w4_omp4", {"OMP_NUM_THREADS": "4"}, ["train", *SLOW_W4, "data.num_workers=4"]),
    (
        "w4_omp1_nopin",
        {"OMP_NUM_THREADS": "1"},
        ["train", *SLOW_W4, "data.num_workers=4", "data.pin_memory=false"],
    ),
    ("w0_omp1", {"OMP_NUM_THREADS": "1"}, ["train", *SLOW_W4, "data.num_workers=0"]),
]

# a llama of 1.01B parameters under fsdp + bf16 on one GPU (part llama1b): 3 epochs of ~23 steps of 8 x 2048 tokens
LLAMA1B = [
    "model.arch=llama",
    "model.n_layer=20",
    "model.n_embd=2048",
    "model.n_head=16",
    "model.dropout=0",
    "data.dataset=text",
    "data.block_size=2048",
    "data.text_bytes=420000",
    "train.batch_size=8",
    "train.epochs=3",
    "train.amp=bf16",
    "optim.name=adamw",
    "eval.every=1000",
    "report.curves=false",
    "dist.strategy=fsdp",
    "--nproc-per-node",
    "1",
]
LLAMA1B_CASES = [
    ("llama1b_fsdp_bf16", ["train", *LLAMA1B]),
    ("llama1b_fsdp_bf16_compile", ["train", *LLAMA1B, "model.compile=true"]),
]

BENCH = Path(__file__).resolve().parent
# The comparisons with hand-written loops: (name, script arguments); each prints its own table.
COMPARISONS: list[tuple[str, list[str]]] = [
    (
        "launch_bound",
        [str(BENCH / "launch_bound.py"), "--device", "cuda", "--nprocs", "1", "--batches", "256"]
        + ["--workers", "0", "4", "--rounds", "2", "--epochs", "5"],
    ),
    *(
        (
            f"resnet18_vs_plain_w{w}",
            [str(BENCH / "throughput_vs_plain_ddp.py"), "--device", "cuda", "--nproc", "1", "--batch", "256"]
            + ["--steps", "100", "--reps", "2", "--wait-quiet", "0", "--workers", str(w)],
        )
        for w in (0, 4)
    ),
]
# the hand-written FSDP2 loop of the same llama (one JSON line each)
LLAMA1B_TORCH = [
    (
        f"llama1b_torch{suffix}",
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            str(BENCH / "llama_fsdp_gpu.py"),
        ]
        + ["--batch", "8", "--block", "2048", *flag],
    )
    for suffix, flag in (("", []), ("_compile", ["--compile"]))
]
PARTS = ("comm", "paths", "resnet50", "comparisons", "workers", "llama1b")
ENV: dict[str, dict[str, str]] = {name: env for name, env, _ in WORKERS}  # a case's own variables


def last_metrics(run: Path) -> dict:
    out: dict = {}
    for row in read_jsonl(run / "metrics.jsonl"):
        out.update({k: v for k, v in row.items() if v is not None})
    return out


def epoch_two(run: Path) -> dict:
    """tokens/s, MFU and peak memory of a run's epoch 2 (after the compile of epoch 1, before the last's evaluation)."""
    rows = [
        r for r in read_jsonl(run / "metrics.jsonl") if r.get("epoch") == 2 and r.get("train_tokens_per_s")
    ]
    if not rows:
        return {}
    r = rows[-1]
    memory = r.get("peak_memory_bytes_per_rank")
    return {
        "train_tokens_per_s": r["train_tokens_per_s"],
        "mfu": r.get("mfu"),
        "peak_memory_gb": round(memory / 1e9, 2) if memory else None,
    }


def run_case(name: str, cmd: list[str], root: Path, timeout: float) -> dict:
    run = root / name
    t0 = time.perf_counter()
    env = {**os.environ, **ENV.get(name, {})}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
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
        if name.startswith("llama1b"):
            res.update(epoch_two(run))
    return res


def train_command(name: str, args: list[str], root: Path) -> list[str]:
    cmd = [sys.executable, "-m", "ddpkit", *args]
    if args[0] == "train":
        cmd.append(f"out_dir={root / name}")
    return cmd


def planned(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(part, name, command) of everything this call runs, in order."""
    out: list[tuple[str, str, list[str]]] = []
    if "comm" in args.parts:
        comm = ["-m", "ddpkit", "comm", "--nproc-per-node", "1", "--json", str(args.out / "comm.json")]
        out.append(("comm", "comm_nccl", [sys.executable, *comm]))
    for name, cargs in CASES:
        part = "resnet50" if name.startswith("resnet50") else "paths"
        if part in args.parts and (not args.only or name in args.only):
            out.append((part, name, train_command(name, cargs, args.out / "runs")))
    if "comparisons" in args.parts:
        out += [("comparisons", name, [sys.executable, *cargs]) for name, cargs in COMPARISONS]
    if "llama1b" in args.parts:
        out += [
            ("llama1b", name, train_command(name, cargs, args.out / "runs")) for name, cargs in LLAMA1B_CASES
        ]
        out += [("llama1b", name, [sys.executable, *cargs]) for name, cargs in LLAMA1B_TORCH]
    if "workers" in args.parts:
        out += [
            ("workers", name, train_command(name, cargs, args.out / "runs")) for name, _, cargs in WORKERS
        ]
    return out


def run_comparison(name: str, cmd: list[str], root: Path, timeout: float) -> dict:
    """A comparison script's run: its exit code, wall time and the ratio lines of its table."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or b""
        rc, out = "timeout", raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    (root / f"{name}.log").write_text(f"$ {' '.join(cmd)}\nrc={rc}\n{out}")
    print(out[-4000:], flush=True)
    table = [ln for ln in out.splitlines() if ln.startswith("|") and "**" in ln]
    ratios = [ln.split("**")[1] for ln in table]
    return {"case": name, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "ratio": " / ".join(ratios)}


def run_handwritten(name: str, cmd: list[str], root: Path, timeout: float) -> dict:
    """The hand-written loop's run (llama_fsdp_gpu.py): its exit code, wall time and the JSON line it prints."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", "", str(e.stderr or "")
    (root / f"{name}.log").write_text(f"$ {' '.join(cmd)}\nrc={rc}\n{out}\n{err}")
    res = {"case": name, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if lines:
        row = json.loads(lines[-1])
        res.update(
            train_tokens_per_s=row["tokens_per_s"], mfu=row["mfu"], peak_memory_gb=row["peak_memory_gb"]
        )
    return res


def summary(results: list[dict]) -> str:
    rows = []
    for r in results:
        if "case" not in r:
            continue
        val = r.get("val_acc1", r.get("val_loss", ""))
        speed = r.get("train_images_per_s") or r.get("train_tokens_per_s") or ""
        extra = [r.get("mfu", ""), r.get("peak_memory_gb", "")]
        rows.append([r["case"], r["rc"], r["wall_s"], val, speed, r.get("ratio", ""), *extra])
    headers = [
        "case",
        "exit",
        "wall s",
        "final val",
        "throughput (/s)",
        "ddpkit / hand-written",
        "MFU",
        "peak GB",
    ]
    return md_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*", help="case names of the paths (default all)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--timeout", type=float, default=90, help="seconds per case")
    p.add_argument("--comparison-timeout", type=float, default=300, help="seconds per comparison")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    plan = planned(args)
    if args.dry_run:
        for part, name, cmd in plan:
            env = " ".join(f"{k}={v}" for k, v in ENV.get(name, {}).items())
            print(f"{part} {name}: {env + ' ' if env else ''}{' '.join(cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs").mkdir(exist_ok=True)
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    print(json.dumps(info), flush=True)
    results: list[dict] = [info]
    for part, name, cmd in plan:
        if part == "comparisons":
            res = run_comparison(name, cmd, args.out, args.comparison_timeout)
        elif part == "comm":
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            (args.out / "comm.log").write_text(proc.stdout + proc.stderr)
            print(proc.stdout[-3000:], proc.stderr[-1500:], flush=True)
            res = {"case": name, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
        elif name.startswith("llama1b_torch"):
            res = run_handwritten(name, cmd, args.out, max(args.timeout, 300))
        else:
            slow = part == "llama1b"  # 3 epochs of a 1B model, one of them compiling it
            res = run_case(name, cmd, args.out / "runs", max(args.timeout, 300) if slow else args.timeout)
        results.append(res)
        print(json.dumps(res), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print()
    print(f"GPU: {info.get('device', 'none')}, torch {info['torch']}")
    print(summary(results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
