"""Measured memory per rank: parameter, gradient and optimizer-state bytes of rank 0's own tensors at the first
optimizer step (the first metrics line's *_bytes_per_rank), for every layout on the built-in transformer.

Each layout is one `ddpkit train` of one optimizer step: model.arch=gpt (2 blocks, width 64, 4 heads, context
32), AdamW, a small text file; 2 processes (4 for dp2 x tp2 and HSDP 2 x 2, 8 for the 3-D layouts), gloo on CPU.

    python benchmarks/memory_per_rank.py                  # the markdown table
    python benchmarks/memory_per_rank.py --json mem.json
    python benchmarks/memory_per_rank.py --only hsdp2x2 fsdp-dp2xtp2xpp2   # some layouts (single always first)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.arch=gpt", "data.dataset=text", "model.n_layer=2", "model.n_head=4", "model.n_embd=64"]
RUN = [*MODEL, "data.block_size=32", "optim.name=adamw", "train.max_steps=1", "report.curves=false"]
LAYOUTS = {  # name: (processes, settings)
    "single": (1, []),
    "ddp": (2, ["dist.strategy=ddp"]),
    "zero1": (2, ["dist.strategy=zero1"]),
    "zero2": (2, ["dist.strategy=zero2"]),
    "fsdp": (2, ["dist.strategy=fsdp"]),
    "fsdp+offload": (2, ["dist.strategy=fsdp", "dist.offload=cpu"]),
    "tp2": (2, ["dist.tp=2"]),
    "pp2": (2, ["dist.pp=2"]),
    "dp2xtp2": (4, ["dist.tp=2"]),
    "hsdp2x2": (4, ["dist.strategy=hsdp", "dist.dp_shard=2"]),
    "ddp-dp2xpp2": (4, ["dist.pp=2"]),
    "fsdp-dp2xpp2": (4, ["dist.pp=2", "dist.strategy=fsdp"]),
    "fsdp-dp2xtp2xpp2": (8, ["dist.tp=2", "dist.pp=2", "dist.strategy=fsdp"]),
    "zero2-dp2xtp2xpp2": (8, ["dist.tp=2", "dist.pp=2", "dist.strategy=zero2"]),
}
FIELDS = ("param_bytes_per_rank", "grad_bytes_per_rank", "optim_bytes_per_rank")


def measure(name: str, nproc: int, settings: list[str], root: Path, text: Path) -> dict:
    out = root / name
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, "-m", "ddpkit", "train", *RUN, f"data.root={text}", f"out_dir={out}", *settings]
    env = {**os.environ, "DDPKIT_OVERSUBSCRIBE": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd + launch, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {"layout": name, "processes": nproc, **{f: first[f] for f in FIELDS}}


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| layout | processes | param B/rank | grad B/rank | optim B/rank | param / single | optim / single |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        p, o = (
            r["param_bytes_per_rank"] / base["param_bytes_per_rank"],
            r["optim_bytes_per_rank"] / base["optim_bytes_per_rank"],
        )
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['param_bytes_per_rank']} | {r['grad_bytes_per_rank']} | "
            f"{r['optim_bytes_per_rank']} | {p:.2f} | {o:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="these layouts (after single)")
    args = parser.parse_args()
    names = ["single", *[n for n in args.only if n != "single"]] if args.only else list(LAYOUTS)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(800)))
        rows = [measure(name, *LAYOUTS[name], Path(tmp), text) for name in names]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
