"""`ddpkit bench`: the same training at each process count, through the real launcher; images/s and scaling.

Each count N runs `python -m ddpkit train ... --nproc-per-node N` in a temporary out_dir for two epochs. With
synthetic data (the default) an epoch is exactly --steps optimizer steps at every N (the set holds
steps x global batch samples; with data.dataset=text, about that many blocks of text), so epoch 1 is the warm-up
(first allocations, DDP's bucket set-up, caches) and epoch 2 is the measurement: its `train_images_per_s` (and a
language model's `train_tokens_per_s`) from metrics.jsonl, the only source of its numbers. The per-process batch
stays fixed, so the global batch grows with N.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.commands.outputs import add_force_flag
from ddpkit.commands.report import (
    check_output,
    flatten,
    load_run,
    markdown,
    png_bytes,
    write_bytes,
)
from ddpkit.commands.train import check_inputs
from ddpkit.config import load_config
from ddpkit.data.registry import get_dataset
from ddpkit.data.text import VAL_FRACTION, min_chars
from ddpkit.errors import UserError, WorkerFailure
from ddpkit.models import language_models

DEFAULT_STEPS = 20
# Used unless the config file or a KEY=VALUE sets them: synthetic data (no download, any size), the built-in CNN.
DEFAULTS = {"data.dataset": "synthetic", "model.arch": "cnn", "data.augment": "false"}
SIZED = ("synthetic", "text")  # the data sets whose epoch --steps sets


def add_flags(parser) -> None:
    """--nproc, --steps and the outputs of `ddpkit bench`."""
    g = parser.add_argument_group("bench")
    g.add_argument(
        "--nproc", required=True, metavar="1,2,4", help="process counts to measure, comma-separated"
    )
    g.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help=f"optimizer steps per epoch, synthetic data (default {DEFAULT_STEPS})",
    )
    g.add_argument("--json", metavar="FILE.json", help="also write the results as JSON")
    g.add_argument("--out", metavar="FILE.png", help="also draw images/s and efficiency against processes")
    add_force_flag(g)


def parse_counts(text: str) -> list[int]:
    """`1,2,4` -> [1, 2, 4]: positive, distinct."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--nproc '{text}' is not a list of numbers", "e.g. --nproc 1,2,4") from None
    if any(n < 1 for n in counts) or len(set(counts)) < len(counts):
        raise UserError(f"--nproc '{text}' must list distinct counts >= 1", "e.g. --nproc 1,2,4")
    return counts


def _keys_set_by_user(config_file: str | None, overrides: list[str]) -> set[str]:
    keys = {o.split("=", 1)[0] for o in overrides}
    if config_file:
        from ddpkit.config.safe_yaml import read_config_file

        keys |= set(flatten(read_config_file(config_file)))  # bounded: size, aliases, nesting
    return keys


def child_argv(cfg, args, n: int, steps: int | None, out_dir: Path) -> list[str]:
    """The `ddpkit train` command line of one count: bench defaults < config file < KEY=VALUE < bench's own keys."""
    user = _keys_set_by_user(args.config, args.overrides)
    argv = [sys.executable, "-m", "ddpkit", "train"] + (["-c", args.config] if args.config else [])
    argv += [f"{k}={_value(cfg, user, k)}" for k in DEFAULTS if k not in user]
    argv += list(args.overrides)
    global_batch = cfg.train.batch_size * n * cfg.train.grad_accum_steps
    own = {"out_dir": str(out_dir), "train.epochs": 2, "train.max_steps": "null", "checkpoint.resume": "none"}
    dataset = _value(cfg, user, "data.dataset")
    if dataset == "synthetic":
        own["data.synthetic_size"] = steps * global_batch
        if "data.synthetic_val_size" not in user:
            own["data.synthetic_val_size"] = global_batch  # the final evaluation stays short
    if dataset == "text":  # about `steps` optimizer steps of blocks, and a tenth as much validation text
        train_chars = steps * global_batch * cfg.data.block_size + 1
        sized = math.ceil(train_chars / (1 - VAL_FRACTION)) + cfg.data.block_size
        own["data.text_bytes"] = max(sized, min_chars(cfg.data.block_size))
    return argv + [f"{k}={v}" for k, v in own.items()] + ["--nproc-per-node", str(n)]


def check_child_inputs(cfg, args, n: int, steps: int) -> None:
    """The checks `ddpkit train` runs on its inputs (data, model, layout), run here on the config of the first
    count's child, so that a bad input ends the bench before it prints anything."""
    argv = child_argv(cfg, args, n, steps, Path(tempfile.gettempdir()) / "ddpkit-bench-check")
    overrides = [a for a in argv[argv.index("train") + 1 : -2] if "=" in a and not a.startswith("-")]
    check_inputs(load_config(args.config, overrides))


def _value(cfg, user: set[str], key: str) -> Any:
    """What the child runs with: the user's value, else bench's default, else the config's default."""
    if key == "model.arch" and key not in user and get_dataset(_value(cfg, user, "data.dataset")).tokens:
        return language_models()[0]  # the default language model, for token data
    if key in DEFAULTS and key not in user:
        return DEFAULTS[key]
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _last_error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ddpkit: error: ")]
    if errors:
        return errors[-1][len("ddpkit: error: ") :]
    err = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    return (err or lines or [f"exit status {proc.returncode}, no output"])[-1]


def threads_per_process(n: int) -> int:
    """CPU threads each of n local workers gets: OMP_NUM_THREADS when set, else cores // n (the launcher's rule)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // n))


def measure(argv: list[str], n: int, out_dir: Path) -> dict[str, Any]:
    """Run one count; its warm-up and timed epochs from metrics.jsonl."""
    threads = threads_per_process(n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # explicit, so the table can say what it measured
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        what = f"bench with {n} process(es) failed (exit {proc.returncode}): {_last_error(proc)}"
        if proc.returncode == 2:
            raise UserError(what, "the same config fails in `ddpkit train`; fix it there")
        raise WorkerFailure(what)
    run = load_run(out_dir, with_config=False)
    if [r["epoch"] for r in run.rows] != [1, 2] or run.rows[1].get("world_size") != n:
        raise WorkerFailure(
            f"bench with {n} process(es): the run did not train epochs 1 and 2 on {n} processes"
        )
    warm, timed = run.rows  # the first line also says what the run trained on
    return {
        "nproc": n,
        "threads_per_process": threads,
        "global_batch_size": timed["global_batch_size"],
        "steps": timed["step"] - warm["step"],
        "images_per_s": timed["train_images_per_s"],
        "epoch_time_s": timed["epoch_time_s"],
        "warmup_images_per_s": warm["train_images_per_s"],
        "tokens_per_s": timed.get("train_tokens_per_s"),
        "warmup_tokens_per_s": warm.get("train_tokens_per_s"),
        "backend": warm.get("backend"),
        "device": warm.get("device"),
    }


def scaling(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add speed-up over the smallest count and efficiency = speed-up / (n / n_min)."""
    base = min(results, key=lambda r: r["nproc"])
    for r in results:
        r["speedup"] = r["images_per_s"] / base["images_per_s"]
        r["efficiency"] = r["speedup"] / (r["nproc"] / base["nproc"])
    return results


def table(results: list[dict[str, Any]]) -> str:
    """The Markdown table of a bench."""
    head = ["processes", "threads/process", "global batch", "steps timed", "images/s", "speed-up"]
    head += ["efficiency", "warm-up images/s"]
    tokens = any(r.get("tokens_per_s") is not None for r in results)
    head += ["tokens/s"] if tokens else []
    body = [
        [
            str(r["nproc"]),
            str(r["threads_per_process"]),
            str(r["global_batch_size"]),
            str(r["steps"]),
            f"{r['images_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{100 * r['efficiency']:.0f}%",
            f"{r['warmup_images_per_s']:.1f}",
        ]
        + ([f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") is not None else "-"] if tokens else [])
        for r in results
    ]
    return markdown(head, body)


def figure(results: list[dict[str, Any]], title: str):
    """Two panels against processes: images/s (with ideal linear scaling) and efficiency."""
    from matplotlib.figure import Figure

    ns = [r["nproc"] for r in results]
    base = min(results, key=lambda r: r["nproc"])
    fig = Figure(figsize=(10.0, 4.5), dpi=100)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.14, top=0.85, wspace=0.25)
    ax1, ax2 = fig.subplots(1, 2)
    ideal = [base["images_per_s"] * n / base["nproc"] for n in ns]
    ax1.plot(ns, ideal, "--", color="gray", label="ideal (linear)")
    ax1.plot(ns, [r["images_per_s"] for r in results], "o-", color="C0", label="measured")
    ax1.set_title("training images/s", fontsize=10)
    ax1.legend(fontsize=9)
    ax2.bar([str(n) for n in ns], [100 * r["efficiency"] for r in results], color="C1")
    ax2.axhline(100, color="gray", linestyle="--", linewidth=1)
    ax2.set_title("scaling efficiency (%)", fontsize=10)
    for ax in (ax1, ax2):
        ax.set_xlabel("processes")
        ax.grid(alpha=0.3)
    ax1.set_xticks(ns)
    fig.suptitle(title, fontsize=10)
    return fig


def bench_command(cfg, args) -> int:
    """`ddpkit bench --nproc 1,2,4`: one training per count, the scaling table on stdout (+ JSON, PNG)."""
    counts = parse_counts(args.nproc)
    json_out = check_output(args.json, ".json", "--json", args.force)
    png_out = check_output(args.out, ".png", "--out", args.force)
    user = _keys_set_by_user(args.config, args.overrides)
    dataset = _value(cfg, user, "data.dataset")
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps} is not >= 1", "e.g. --steps 20")
    if args.steps is not None and dataset not in SIZED:
        raise UserError(
            f"--steps sets the epoch length of synthetic or text data, not of data.dataset={dataset}",
            "drop --steps (each epoch is then one pass over the data set) or use data.dataset=synthetic",
        )
    steps = args.steps or DEFAULT_STEPS
    load = (
        os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    )  # other work on the machine skews the figures
    check_child_inputs(cfg, args, counts[0], steps)  # a bad input is one line, before any progress line
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        for n in counts:
            out_dir = Path(tmp) / f"nproc{n}"
            print(f"bench: {n} process(es) ...", file=sys.stderr, flush=True)
            results.append(measure(child_argv(cfg, args, n, steps, out_dir), n, out_dir))
    scaling(results)
    where = f"{results[0]['backend']}, {results[0]['device']}"
    title = f"ddpkit bench ({where}, {dataset}, model.arch={_value(cfg, user, 'model.arch')})"
    doc = {
        "generated_by": "ddpkit bench",
        "dataset": dataset,
        "steps_per_epoch": steps if dataset in SIZED else None,
        "overrides": list(args.overrides),
        "cpus": os.cpu_count(),
        "load_average_at_start": load,
        "results": results,
    }
    if json_out is not None:
        write_bytes(json_out, (json.dumps(doc, indent=2) + "\n").encode("utf-8"))
    if png_out is not None:
        write_bytes(png_out, png_bytes(figure(results, title)))
    print(f"{title}: images/s of the second epoch (the first is the warm-up)\n")
    print(table(results))
    return 0
