"""Digits: time to 98% validation accuracy, ddpkit's default recipe vs the tutorials' recipe, in the same run.

Both recipes train the same model (the built-in CNN) on the same data (scikit-learn's digits, the fixed
1,438/359 split) with `ddpkit train --nproc-per-node 2`, for the same number of epochs (those of
configs/digits.yaml), each into its own temporary out_dir:

  default    -c configs/digits.yaml
  tutorials  -c configs/digits.yaml optim.lr=0.01 optim.ref_batch_size=null train.batch_size=128
             optim.schedule=constant optim.warmup_epochs=0
             (the tutorials' lr 0.01, constant, global batch 256 = 128 per process x 2 processes)

For every seed the two recipes run one after the other (the order alternates between seeds). For each run:
  - wall time since launch at which the epoch whose val_acc1 first reaches >= 0.98 finished (its log line
    appeared: training, evaluation and checkpoint of that epoch included, process start-up included),
  - train time to that point (sum of metrics.jsonl's epoch_time_s: the training loops only),
  - the epoch, or "not reached" and the best val_acc1,
  - total wall time and final val_acc1.

    python benchmarks/digits_time_to_acc.py                  # seeds 0 1 2
    python benchmarks/digits_time_to_acc.py --seeds 0 --echo # one seed, show the training output
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, machine_line, md_table, python, read_jsonl, run_streaming  # noqa: E402

CONFIG = "configs/digits.yaml"
RECIPES: dict[str, list[str]] = {
    "default": [],
    "tutorials": [
        "optim.lr=0.01",
        "optim.ref_batch_size=null",
        "train.batch_size=128",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
        "train.label_smoothing=0",
    ],
}
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) \|")


def command(recipe: str, seed: int, out_dir: str, nproc: int, extra: list[str]) -> list[str]:
    return [
        python(),
        "-m",
        "ddpkit",
        "train",
        "-c",
        CONFIG,
        *RECIPES[recipe],
        f"seed={seed}",
        f"out_dir={out_dir}",
        "checkpoint.resume=none",
        *extra,
        "--nproc-per-node",
        str(nproc),
    ]


def run_one(
    recipe: str, seed: int, nproc: int, threshold: float, extra: list[str], echo: bool
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"ddpkit-bench-digits-{recipe}-") as tmp:
        out_dir = str(Path(tmp) / "run")
        cmd = command(recipe, seed, out_dir, nproc, extra)
        epoch_done: dict[int, float] = {}

        def on_line(t: float, line: str) -> None:
            m = EPOCH_LINE.match(line)
            if m:
                epoch_done[int(m.group(1))] = t

        rc, wall, lines = run_streaming(cmd, env={}, echo=echo, on_line=on_line)
        rows = read_jsonl(Path(out_dir) / "metrics.jsonl")
    if rc != 0:
        tail = "\n".join(line for _, line in lines[-20:])
        raise SystemExit(f"{recipe} (seed {seed}) failed with exit code {rc}:\n{tail}")
    shown = " ".join(a for a in cmd[1:] if not a.startswith("out_dir="))
    res: dict[str, Any] = {
        "recipe": recipe,
        "seed": seed,
        "command": "python " + shown + " out_dir=TMP",
        "epochs": len(rows),
        "global_batch_size": rows[-1]["global_batch_size"] if rows else None,
        "total_wall_s": round(wall, 2),
        "total_train_s": round(sum(r["epoch_time_s"] for r in rows), 2),
        "final_val_acc1": rows[-1]["val_acc1"] if rows else None,
        "best_val_acc1": max((r["val_acc1"] for r in rows if r["val_acc1"] is not None), default=None),
        "val_acc1_per_epoch": [r["val_acc1"] for r in rows],
        "reached_epoch": None,
        "reached_wall_s": None,
        "reached_train_s": None,
    }
    train_s = 0.0
    for r in rows:
        train_s += r["epoch_time_s"]
        if r["val_acc1"] is not None and r["val_acc1"] >= threshold:
            res["reached_epoch"] = r["epoch"]
            res["reached_wall_s"] = round(epoch_done.get(r["epoch"], float("nan")), 2)
            res["reached_train_s"] = round(train_s, 2)
            break
    return res


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def report(
    results: list[dict[str, Any]], threshold: float, m: dict[str, Any], nproc: int, argv: list[str]
) -> str:
    thr = f"{100 * threshold:g}%"
    lines = [
        f"Machine: {machine_line(m)}",
        f"Command: python benchmarks/digits_time_to_acc.py {' '.join(argv)}".rstrip(),
        f"Each run: ddpkit train --nproc-per-node {nproc}, {results[0]['epochs']} epochs, into a temporary out_dir.",
        "",
    ]
    rows = []
    for r in results:
        reached = (
            f"epoch {r['reached_epoch']}: {r['reached_wall_s']:.1f} s wall ({r['reached_train_s']:.1f} s training)"
            if r["reached_epoch"]
            else f"not reached (best {pct(r['best_val_acc1'])})"
        )
        rows.append(
            [
                r["recipe"],
                r["seed"],
                r["global_batch_size"],
                reached,
                f"{r['total_wall_s']:.1f} s ({r['total_train_s']:.1f} s training)",
                pct(r["final_val_acc1"]),
                pct(r["best_val_acc1"]),
            ]
        )
    lines.append(
        md_table(
            [
                "recipe",
                "seed",
                "global batch",
                f"first val_acc1 >= {thr}",
                "total wall (training)",
                "final val_acc1",
                "best val_acc1",
            ],
            rows,
        )
    )
    lines.append("")
    summary = []
    for recipe in RECIPES:
        rs = [r for r in results if r["recipe"] == recipe]
        if not rs:
            continue
        hit = [r for r in rs if r["reached_epoch"]]

        def med(key, hit=hit):
            return statistics.median(r[key] for r in hit)

        summary.append(
            [
                recipe,
                f"{len(hit)}/{len(rs)}",
                "-" if not hit else f"{med('reached_wall_s'):.1f} s (epoch {med('reached_epoch'):g})",
                "-" if not hit else f"{med('reached_train_s'):.1f} s",
                f"{statistics.median(r['total_wall_s'] for r in rs):.1f} s",
                pct(statistics.median(r["final_val_acc1"] for r in rs)),
                f"{pct(min(r['final_val_acc1'] for r in rs))} .. {pct(max(r['final_val_acc1'] for r in rs))}",
            ]
        )
    lines.append(
        md_table(
            [
                "recipe",
                f"seeds reaching {thr}",
                "median wall to it",
                "median training time to it",
                "median total wall",
                "median final val_acc1",
                "final val_acc1 range",
            ],
            summary,
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threshold", type=float, default=0.98)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--echo", action="store_true", help="show the training output")
    p.add_argument(
        "extra", nargs="*", help="KEY=VALUE overrides added to both recipes (e.g. to try other values)"
    )
    raw = sys.argv[1:] if argv is None else argv
    args = p.parse_args(raw)
    m = machine()
    print(f"digits time-to-{100 * args.threshold:g}%: {machine_line(m)}", flush=True)
    results = []
    for i, seed in enumerate(args.seeds):
        order = args.recipes if i % 2 == 0 else list(reversed(args.recipes))
        for recipe in order:
            print(f"  running {recipe} recipe, seed {seed} ...", flush=True)
            r = run_one(recipe, seed, args.nproc, args.threshold, args.extra, args.echo)
            reached = (
                f"epoch {r['reached_epoch']} at {r['reached_wall_s']} s"
                if r["reached_epoch"]
                else "not reached"
            )
            print(
                f"    {reached}; final val_acc1 {pct(r['final_val_acc1'])}, total {r['total_wall_s']} s",
                flush=True,
            )
            results.append(r)
    order = {name: k for k, name in enumerate(RECIPES)}
    results.sort(key=lambda r: (order[r["recipe"]], r["seed"]))
    print()
    print(report(results, args.threshold, m, args.nproc, raw))
    print()
    print("Commands (out_dir is a temporary folder):")
    for recipe in args.recipes:
        print(f"  {recipe}: " + next(r["command"] for r in results if r["recipe"] == recipe))
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "results": results}, indent=1))
        print(f"raw results: {args.json}")
    default = [r for r in results if r["recipe"] == "default"]
    return 0 if all(r["reached_epoch"] for r in default) else 1


if __name__ == "__main__":
    raise SystemExit(main())
