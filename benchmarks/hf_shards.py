"""Hugging Face folders read and written as shards: the peak memory a rank adds when `ddpkit train` starts from a
folder (model.init_from) under fsdp, and the peak memory of `ddpkit export` streaming a sharded checkpoint.

The model is issue 39's: a Llama of 16 blocks, width 1024 (16 heads, SwiGLU 2736, vocabulary 256): 201.6M
parameters, 0.81 GB in float32, saved as a Hugging Face folder in shards of 200 MB. Every run is one optimizer step
(AdamW, batch 1 per rank, context 32) on token files, fsdp over N processes, sharded checkpoints; each measured
twice, once with the 201M model and once with a tiny one of the same depth (width 64: 0.9M parameters), so that
what the model adds to a rank's peak resident memory (metrics peak_memory_bytes_per_rank, the largest rank's)
is the difference. Three starts: random initial weights (the model's shape given as keys), model.init_from of the
folder, and the export of the sharded checkpoint the init_from run wrote (`ddpkit export --max-shard-size 100MB`,
its peak resident memory measured by /usr/bin/time).

    python benchmarks/hf_shards.py                        # 8 processes, the markdown table
    python benchmarks/hf_shards.py --probe                # model.init_from only: building vs the step apart
    python benchmarks/hf_shards.py --nproc 4 --src /tmp/old/src   # another checkout's code (PYTHONPATH)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIG = {"n_layer": 16, "n_embd": 1024, "n_head": 16, "ffn_hidden": 2736}
TINY = {"n_layer": 16, "n_embd": 64, "n_head": 4, "ffn_hidden": 176}
VOCAB, CONTEXT = 256, 32
RUN = [
    "data.dataset=tokens", f"data.block_size={CONTEXT}", "train.batch_size=1", "train.max_steps=1",
    "optim.name=adamw", "optim.ref_batch_size=null", "report.curves=false", "checkpoint.format=sharded",
    "dist.strategy=fsdp", "data.num_workers=0",
]  # fmt: skip


def make_folder(shape: dict, out: Path) -> None:
    """A Llama of `shape` with random weights, written as a Hugging Face folder by this checkout's export."""
    code = (
        "import sys, torch\n"
        "from ddpkit.models import family_of_module\n"
        "from ddpkit.models.hf import export\n"
        "from ddpkit.models.llama.model import Llama\n"
        "torch.manual_seed(0)\n"
        f"m = Llama({VOCAB}, 64, {shape['n_layer']}, {shape['n_head']}, {shape['n_embd']}, "
        f"ffn_hidden={shape['ffn_hidden']}, norm_eps=1e-6)\n"
        f"export(m, sys.argv[1], family_of_module(m), max_shard_size='200MB')\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(out)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


def train(out: Path, data: Path, nproc: int, src: Path, start: list[str]) -> int:
    """The largest rank's peak resident memory in one `ddpkit train` step."""
    cmd = [sys.executable, "-m", "ddpkit", "train", f"out_dir={out}", f"data.root={data}", *RUN, *start]
    cmd += ["--nproc-per-node", str(nproc), "--oversubscribe"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}, timeout=3600
    )
    if proc.returncode:
        raise SystemExit(f"{out.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return int(first["peak_memory_bytes_per_rank"])


def export_peak(run: Path, out: Path, src: Path) -> int:
    """The peak resident memory of `ddpkit export` of the run's last checkpoint, in bytes."""
    cmd = [
        "/usr/bin/time",
        "-f",
        "%M",
        sys.executable,
        "-m",
        "ddpkit",
        "export",
        str(run),
        "--to",
        "hf",
        str(out),
    ]
    flags = ["--max-shard-size", "100MB"] if "--max-shard-size" in _help(src) else []
    proc = subprocess.run(
        cmd + flags, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}
    )
    if proc.returncode:
        raise SystemExit(f"export: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return int(proc.stderr.strip().splitlines()[-1]) * 1024


def _help(src: Path) -> str:
    cmd = [sys.executable, "-m", "ddpkit", "export", "--help"]
    return subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}
    ).stdout


def probe(out: Path, data: Path, nproc: int, src: Path, start: list[str]) -> dict[str, int]:
    """The largest rank's peak resident memory once the Trainer is built (the model laid out and the folder
    read) and after one step, by benchmarks/peak_probe.py."""
    settings = [f"out_dir={out}", f"data.root={data}", *RUN, *start]
    cmd = [sys.executable, "-m", "ddpkit", "run", "--nproc-per-node", str(nproc), "--oversubscribe"]
    cmd += [str(ROOT / "benchmarks" / "peak_probe.py"), str(out) + ".json", *settings]
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{out.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    ranks = json.loads(Path(str(out) + ".json").read_text())["ranks"]
    return {k: max(r[k] for r in ranks) for k in ("start", "built", "stepped", "stepped2")}


def probe_folder(nproc: int, src: Path, tmp: Path, more: list[str]) -> None:
    """model.init_from of the tiny and the 201M folder, building and the step apart: a markdown table."""
    data = _tokens(tmp, nproc)
    got = {}
    for name, shape in (("tiny", TINY), ("big", BIG)):
        make_folder(shape, tmp / f"hf-{name}")
        got[name] = probe(
            tmp / f"probe-{name}", data, nproc, src, [f"model.init_from={tmp / f'hf-{name}'}", *more]
        )
    model = sum(f.stat().st_size for f in (tmp / "hf-big").glob("*.safetensors"))
    print(f"| {nproc} processes, fsdp, model.init_from | tiny | 201M | added | added / model bytes |")
    print("|---|---|---|---|---|")
    steps = (("stepped", "after one AdamW step"), ("stepped2", "after the second step"))
    for k, what in (("built", "built: laid out, folder read"), *steps):
        tiny, big = got["tiny"][k], got["big"][k]
        print(
            f"| {what} | {tiny / 2**20:.0f} MiB | {big / 2**20:.0f} MiB | {(big - tiny) / 2**20:.0f} MiB | {(big - tiny) / model:.2f} |"
        )


def _tokens(tmp: Path, nproc: int) -> Path:
    data = tmp / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)  # the validation set: one block per rank (its pass costs a step's forward)
    for split, n in (("train", 64 * (CONTEXT + 1)), ("val", nproc * CONTEXT + 1)):
        rng.integers(0, VOCAB, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    return data


def keys(shape: dict) -> list[str]:
    return ["model.arch=llama", "model.norm_eps=1e-6", *[f"model.{k}={v}" for k, v in shape.items()]]


def measure(nproc: int, src: Path, tmp: Path) -> dict[str, int]:
    data = _tokens(tmp, nproc)
    got = {}
    for name, shape in (("tiny", TINY), ("big", BIG)):
        make_folder(shape, tmp / f"hf-{name}")
        given = [
            *keys(shape),
            f"data.vocab_size={VOCAB}",
        ]  # an earlier checkout needs them with init_from too
        got[f"random {name}"] = train(tmp / f"random-{name}", data, nproc, src, given)
        got[f"folder {name}"] = train(
            tmp / f"folder-{name}", data, nproc, src, [*given, f"model.init_from={tmp / f'hf-{name}'}"]
        )
        got[f"bytes {name}"] = sum(f.stat().st_size for f in (tmp / f"hf-{name}").glob("*.safetensors"))
        got[f"export {name}"] = export_peak(tmp / f"folder-{name}", tmp / f"export-{name}", src)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument(
        "--src", type=Path, default=ROOT / "src", help="the ddpkit source to run (PYTHONPATH)"
    )
    parser.add_argument("--json", help="write the numbers here too")
    parser.add_argument("--probe", action="store_true", help="model.init_from: building and the step apart")
    parser.add_argument("--set", nargs="+", default=[], help="--probe: more overrides (dist.memory=lean)")
    args = parser.parse_args()
    if args.probe:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            return probe_folder(args.nproc, args.src, Path(tmp), args.set)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        got = measure(args.nproc, args.src, Path(tmp))
    model = got["bytes big"]  # the 201M model's float32 bytes (its folder's, headers aside: ~0.01%)
    print(
        f"| start | {args.nproc} processes, fsdp: peak per rank, tiny | 201M | added | added / model bytes |"
    )
    print("|---|---|---|---|---|")
    for start in ("random", "folder", "export"):
        tiny, big = got[f"{start} tiny"], got[f"{start} big"]
        print(
            f"| {start} | {tiny / 2**20:.0f} MiB | {big / 2**20:.0f} MiB | {(big - tiny) / 2**20:.0f} MiB | {(big - tiny) / model:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=2))


if __name__ == "__main__":
    main()
