"""Measured memory per rank: parameter, gradient and optimizer-state bytes of rank 0's own tensors at the first
optimizer step (the first metrics line's *_bytes_per_rank), for every layout on the built-in transformer.

Each layout is one `ddpkit train` of one optimizer step: model.arch=gpt (2 blocks, width 64, 4 heads, context
32), AdamW, a small text file; 2 processes (4 for dp2 x tp2 and HSDP 2 x 2, 8 for the 3-D layouts), gloo on CPU.

    python benchmarks/memory_per_rank.py                  # the markdown table
    python benchmarks/memory_per_rank.py --json mem.json
    python benchmarks/memory_per_rank.py --only hsdp2x2 fsdp-dp2xtp2xpp2   # some layouts (single always first)

`--peak`: each rank's peak resident memory while building and during the first two optimizer steps of a 201M-parameter
llama (16 blocks, width 1024) under dist.strategy=fsdp on 1, 2, 4 and 8 processes (benchmarks/peak_probe.py, one
run at a time), beside the same runs at width 64 (the fixed costs: torch, the data, the process group): what the
model adds to a rank's peak, against the model's own bytes. `--src DIR` measures another checkout's ddpkit (its
src/ folder: the code before a change).

    python benchmarks/memory_per_rank.py --peak --ranks 1 2 4 8 --json peak.json
    python benchmarks/memory_per_rank.py --peak --ranks 8 --src /path/to/other/checkout/src
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


# --peak: the 201M-parameter llama of the peak table, and its width-64 twin (the fixed costs)
LLAMA = ["model.arch=llama", "data.dataset=text", "model.n_layer=16", "model.n_head=16"]
PEAK_RUN = [*LLAMA, "data.block_size=32", "optim.name=adamw", "dist.strategy=fsdp"]
GLOBAL_BATCH = 8  # train.batch_size = 8 / processes: every run takes the same first step
WIDTHS = {"model": 1024, "fixed": 64}
PROBE = Path(__file__).resolve().parent / "peak_probe.py"


def measure_peak(nproc: int, width: int, root: Path, text: Path, src: Path, more: list[str]) -> dict:
    """One probe run (benchmarks/peak_probe.py) of `nproc` processes: each rank's peaks, the weights' fingerprint."""
    out = root / f"peak_{nproc}_{width}.json"
    settings = [*PEAK_RUN, f"model.n_embd={width}", f"train.batch_size={GLOBAL_BATCH // nproc}", *more]
    settings += [f"data.root={text}", f"out_dir={root / 'run'}"]
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd = [sys.executable, "-m", "ddpkit", "run", *launch, str(PROBE), str(out), *settings]
    env = {**os.environ, "DDPKIT_OVERSUBSCRIBE": "1", "PYTHONPATH": str(src)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{nproc} x width {width}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def peak_rows(ranks: list[int], src: Path, text: Path, tmp: Path, more: list[str]) -> list[dict]:
    """Per rank count: the largest rank's peak after building and after the first step, at width 1024 and 64."""
    rows = []
    for n in ranks:
        row: dict = {"processes": n}
        for kind, width in WIDTHS.items():
            got = measure_peak(n, width, tmp, text, src, more)
            row[f"{kind}_built"] = max(r["built"] for r in got["ranks"])
            row[f"{kind}_stepped"] = max(r["stepped"] for r in got["ranks"])
            row[f"{kind}_stepped2"] = max(r["stepped2"] for r in got["ranks"])
            row[f"{kind}_weights"] = [got["weights_before"], got["weights_after"]]
            row[f"{kind}_params"] = got["params"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def peak_table(rows: list[dict]) -> str:
    lines = [
        "| processes | peak after building (GB) | fixed (GB) | added / model | peak after step 1 (GB) | fixed (GB) "
        "| added / model | peak after step 2 (GB) | fixed (GB) | added / model |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        model_bytes = 4 * r["model_params"]  # float32 weights
        cells = [str(r["processes"])]
        for phase in ("built", "stepped", "stepped2"):
            model, fixed = r[f"model_{phase}"], r[f"fixed_{phase}"]
            cells += [f"{model / 1e9:.2f}", f"{fixed / 1e9:.2f}", f"{(model - fixed) / model_bytes:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="these layouts (after single)")
    parser.add_argument("--peak", action="store_true", help="the peak-memory table of the 201M llama (fsdp)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8], help="--peak: process counts")
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="--peak: the ddpkit source to measure")
    parser.add_argument("--set", nargs="+", default=[], help="--peak: more overrides (dist.memory=lean)")
    args = parser.parse_args()
    if args.peak:
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(tmp) / "corpus.txt"
            text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(800)))
            rows = peak_rows(args.ranks, args.src.resolve(), text, Path(tmp), args.set)
        print(peak_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
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
