"""Checkpoints in the background, measured: the seconds training is blocked by checkpointing (the metrics field
checkpoint_stall_s, summed over the run) with blocking sharded saves and with checkpoint.async_save=true.

Each run is one `ddpkit train` of a Llama of about 63M parameters (by default: 10 blocks, width 768, 12 heads, 4 key/value
heads; AdamW, so a checkpoint holds the weights and two moments: about 0.76 GB) on the built-in text data,
--steps optimizer steps with a sharded checkpoint after every step (checkpoint.every_steps=1, and the epoch's at
the end: the last one is waited for before the run's last line). The two settings run in alternated rounds;
the table gives each round's summed stall, wall time and training time (the sum of epoch_time_s), and the
ratio of the medians.

    python benchmarks/checkpoint_stall.py
    python benchmarks/checkpoint_stall.py --layers 6 --width 480 --steps 4 --rounds 1
    python benchmarks/checkpoint_stall.py --nproc 2 --strategy fsdp --rounds 2 --json stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, machine_line, md_table, python, read_jsonl, run_measured  # noqa: E402

MODEL = [
    "model.arch=llama",
    "model.n_head=12",
    "model.n_kv_head=4",
    "data.dataset=text",
    "data.text_bytes=60000",
    "data.block_size=128",
    "optim.name=adamw",
    "report.curves=false",
]


def command(args, out: Path, background: bool) -> list[str]:
    cmd = [
        python(),
        "-m",
        "ddpkit",
        "train",
        *MODEL,
        f"model.n_layer={args.layers}",
        f"model.n_embd={args.width}",
    ]
    cmd += [f"out_dir={out}", f"train.batch_size={args.batch}"]
    cmd += [f"train.max_steps={args.steps}", "train.epochs=1", f"dist.strategy={args.strategy}"]
    cmd += [
        "checkpoint.format=sharded",
        "checkpoint.every_steps=1",
        f"checkpoint.async_save={str(background).lower()}",
    ]
    return cmd + (["--nproc-per-node", str(args.nproc)] if args.nproc > 1 else [])


def run(args, root: Path, name: str, background: bool) -> dict:
    out = root / name
    measured = run_measured(command(args, out, background), name, env={"DDPKIT_OVERSUBSCRIBE": "1"})
    rows = read_jsonl(out / "metrics.jsonl")
    return {
        "setting": "async_save=true" if background else "blocking",
        "stall_s": round(sum(r["checkpoint_stall_s"] for r in rows), 3),
        "train_s": round(sum(r["epoch_time_s"] for r in rows), 3),
        "wall_s": round(measured["wall_s"], 2),
        "load1": measured["load1"],
        "other_cores": measured["other_cores"],
        "steps": rows[-1]["step"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run, one checkpoint after each")
    ap.add_argument("--batch", type=int, default=4, help="train.batch_size (blocks of 128 characters)")
    ap.add_argument("--layers", type=int, default=10, help="model.n_layer")
    ap.add_argument("--width", type=int, default=768, help="model.n_embd (a multiple of 12 heads)")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="also write the runs here")
    args = ap.parse_args(argv)
    info = machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        for rnd in range(args.rounds):
            for background in (False, True) if rnd % 2 == 0 else (True, False):
                t0 = time.time()
                r = run(args, Path(tmp), f"r{rnd}-{background}", background)
                runs.append(r)
                print(
                    f"  round {rnd + 1} {r['setting']}: stall {r['stall_s']:.2f} s of {r['train_s']:.1f} s training "
                    f"({time.time() - t0:.0f} s, load {r['load1']:.1f})",
                    flush=True,
                )
    print(machine_line(info))
    print(
        f"llama {args.layers} blocks, width {args.width}; {args.steps} steps of {args.batch} blocks, "
        f"{args.nproc} process(es), dist.strategy={args.strategy}"
    )
    rows = [
        [i // 2 + 1, r["setting"], r["stall_s"], r["train_s"], r["wall_s"], f"{r['load1']:.1f}"]
        for i, r in enumerate(runs)
    ]
    print(md_table(["round", "setting", "summed checkpoint_stall_s", "training s", "wall s", "load"], rows))
    med = {
        s: statistics.median(r["stall_s"] for r in runs if r["setting"] == s)
        for s in ("blocking", "async_save=true")
    }
    print(
        f"median stall: blocking {med['blocking']:.2f} s, async {med['async_save=true']:.2f} s, "
        f"ratio {med['async_save=true'] / med['blocking']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
