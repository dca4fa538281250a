"""`ddpkit report`: read run directories, draw their curves, tabulate and compare them (PNG, Markdown, HTML, JSON).

A run is read from its out_dir: metrics.jsonl, the only source of its numbers (one line per finished epoch; when
an epoch appears twice the later line wins; a line's `resumed_after` field, or an epoch number that goes
backwards, marks a resume) and config.yaml (the resolved config; what differs between runs names them in the
legend). Language-model runs are tabulated by their validation loss, perplexity and tokens/s. matplotlib is
imported only when a picture is drawn (train/curves/drawing.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ddpkit.commands.outputs import add_force_flag, check_output
from ddpkit.errors import UserError
from ddpkit.parallel.plan import resolve_strategy
from ddpkit.train.curves import (  # the run read back and its curves drawn, shared with the Trainer
    LAUNCHER_DRAWS_VAR,
    LauncherCurves,
    drawing,
    launcher_draws,
    write_bytes,
    write_curves,
)
from ddpkit.train.curves.drawing import figure, finite, html_page, is_language_model, png_bytes
from ddpkit.train.curves.runs import _PLOTTED, _PLOTTED_LM, Run, flatten, load_run

FIG_SIZE_IN, FIG_DPI = drawing.FIG_SIZE_IN, drawing.FIG_DPI  # the picture's size, named here too

__all__ = [  # bench's outputs are checked the same way; the rest live in train/curves, named here too
    "check_output",
    "LAUNCHER_DRAWS_VAR",
    "LauncherCurves",
    "Run",
    "flatten",
    "launcher_draws",
    "load_run",
    "write_curves",
]


def _mean(values: list[Any]) -> float | None:
    nums = [v for v in values if v is not None and math.isfinite(v)]
    return sum(nums) / len(nums) if nums else None


def _label_value(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def differing_keys(runs: list[Run]) -> list[str]:
    """Config keys (and world_size, from the metrics) whose values are not the same in every run."""
    if len(runs) < 2:
        return []
    keys = sorted(set().union(*(r.config for r in runs)) - {"out_dir"})
    diff = [k for k in keys if len({json.dumps(r.config.get(k), default=str) for r in runs}) > 1]
    if len({r.sizes("world_size") for r in runs}) > 1:
        diff.insert(0, "world_size")
    return diff


def _differs(run: Run, keys: list[str]) -> dict[str, Any]:
    return {k: run.sizes("world_size") if k == "world_size" else run.config.get(k) for k in keys}


def _pairs(differs: dict[str, Any]) -> str:
    return " ".join(f"{k}={_label_value(v)}" for k, v in differs.items())


def labels(runs: list[Run], keys: list[str]) -> list[str]:
    """Legend names: what differs in each run's config (`world_size=2 optim.lr=0.4`), else the folder's name."""
    out = [_pairs(_differs(r, keys)) or r.path.name for r in runs]
    if len(set(out)) < len(out):
        out = [
            f"{lab} [{r.path}]" if lab != str(r.path.name) else str(r.path)
            for lab, r in zip(out, runs, strict=True)
        ]
    return out


def summarize(run: Run, label: str, keys: list[str], target: float | None) -> dict[str, Any]:
    """One run's row of the report: accuracies, time to target, throughput, sizes, strategy, what differs."""
    rows = run.rows
    acc = [(r["epoch"], r.get("val_acc1")) for r in rows if r.get("val_acc1") is not None]
    best = max(acc, key=lambda ea: ea[1]) if acc else (None, None)
    reached, wall, cum = None, None, 0.0
    for r in rows:
        cum += r.get("epoch_time_s") or 0.0
        if target is not None and r.get("val_acc1") is not None and r["val_acc1"] >= target:
            reached, wall = r["epoch"], cum
            break
    world = rows[-1].get("world_size")
    plotted_lm = _PLOTTED_LM if is_language_model(run) else ()
    strategy = run.config.get("dist.strategy", "auto")
    if strategy == "auto":  # what `auto` resolved to (ddpkit.parallel.plan.resolve_strategy)
        strategy = resolve_strategy("auto", world or 1)
    return {
        "run": str(run.path),
        "label": label,
        "epochs": rows[-1]["epoch"],
        "world_size": run.sizes("world_size"),
        "global_batch_size": run.sizes("global_batch_size"),
        "strategy": strategy,
        "final_val_acc1": finite(acc[-1][1]) if acc else None,
        "best_val_acc1": finite(best[1]),
        "best_epoch": best[0],
        "target_epoch": reached,
        "target_wall_s": wall,
        "mean_images_per_s": _mean(run.series("train_images_per_s")),
        "train_time_s": sum(r.get("epoch_time_s") or 0.0 for r in rows),
        "resumed_after": run.resumed_after,
        "differs": _differs(run, keys),
        "series": {k: [finite(v) for v in run.series(k)] for k in ("epoch", *_PLOTTED, *plotted_lm)},
        **(_language_model_summary(run) if plotted_lm else {}),
    }


def _language_model_summary(run: Run) -> dict[str, Any]:
    """A language model's numbers: final and best (lowest) val_loss, final perplexity, mean tokens/s, mean
    TFLOP/s per rank and MFU, the largest peak memory per rank."""
    losses = [(r["epoch"], r["val_loss"]) for r in run.rows if finite(r.get("val_loss")) is not None]
    best = min(losses, key=lambda el: el[1]) if losses else (None, None)
    ppl = [r["val_ppl"] for r in run.rows if finite(r.get("val_ppl")) is not None]
    return {
        "final_val_loss": losses[-1][1] if losses else None,
        "best_val_loss": best[1],
        "best_val_loss_epoch": best[0],
        "final_val_ppl": ppl[-1] if ppl else None,
        "mean_tokens_per_s": _mean(run.series("train_tokens_per_s")),
        "mean_tflops_per_s_per_rank": _mean(run.series("tflops_per_s_per_rank")),
        "mean_mfu": _mean(run.series("mfu")),
        # a mixture of experts' routing in the last line that has it: aux loss, load (busiest expert / mean)
        **{f"final_{k}": _last(run.series(k)) for k in MOE_FIELDS},
        "peak_memory_bytes_per_rank": max(
            (
                v
                for v in run.series("peak_memory_bytes_per_rank")
                if isinstance(v, int) and not isinstance(v, bool)
            ),
            default=None,
        ),
    }


MOE_FIELDS = ("moe_aux_loss", "moe_balance_max", "moe_balance_mean")


def _last(values: list[Any]) -> float | None:
    """The last finite number of a series (None when it has none)."""
    return next((finite(v) for v in reversed(values) if finite(v) is not None), None)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(summary: list[dict[str, Any]], target: float | None) -> tuple[list[str], list[list[str]]]:
    """The report's table: headers and one row of cells per run."""
    head = ["run", "world size", "global batch", "strategy", "epochs", "final val_acc1"]
    head += ["best val_acc1 (epoch)"]
    if target is not None:
        head += [f"epoch reaching {_pct(target)}", f"train time to {_pct(target)} (s)"]
    lm = any("final_val_loss" in s for s in summary)  # language-model runs: loss, perplexity, tokens/s too
    if lm:
        head += ["final val_loss", "best val_loss (epoch)", "final val ppl", "mean tokens/s"]
        head += ["TFLOP/s per rank", "MFU", "peak memory per rank (MiB)"]
    moe = any(
        s.get("final_moe_balance_max") is not None for s in summary
    )  # mixtures of experts: their routing
    if moe:
        head += ["MoE aux loss", "MoE load max / mean"]
    head += ["mean images/s", "train time (s)", "resumed after epoch", "differs"]
    body = []
    for s in summary:
        row = [s["run"], s["world_size"], s["global_batch_size"], s["strategy"], str(s["epochs"])]
        best = "-" if s["best_val_acc1"] is None else f"{_pct(s['best_val_acc1'])} ({s['best_epoch']})"
        row += [_pct(s["final_val_acc1"]), best]
        if target is not None:
            row += [_num(s["target_epoch"], "d"), _num(s["target_wall_s"], ".2f")]
        if lm:
            best_loss = s.get("best_val_loss")
            row += [_num(s.get("final_val_loss"), ".4f")]
            row += ["-" if best_loss is None else f"{best_loss:.4f} ({s['best_val_loss_epoch']})"]
            row += [_num(s.get("final_val_ppl"), ".2f"), _num(s.get("mean_tokens_per_s"), ".1f")]
            row += [_num(s.get("mean_tflops_per_s_per_rank"), ".4g"), _pct(s.get("mean_mfu"))]
            mem = s.get("peak_memory_bytes_per_rank")
            row += [_num(None if mem is None else mem / 2**20, ".1f")]
        if moe:
            load = [s.get(f"final_moe_balance_{k}") for k in ("max", "mean")]
            row += [_num(s.get("final_moe_aux_loss"), ".4f")]
            row += ["-" if None in load else f"{load[0]:.3f} / {load[1]:.3f}"]
        row += [_num(s["mean_images_per_s"], ".1f"), _num(s["train_time_s"], ".2f")]
        row += [", ".join(map(str, s["resumed_after"])) or "-", _pairs(s["differs"]) or "-"]
        body.append(row)
    return head, body


def markdown(head: list[str], body: list[list[str]]) -> str:
    """A Markdown table (pipes in cells escaped)."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), line(["---"] * len(head)), *map(line, body)])


def add_flags(parser) -> None:
    """RUN_DIR ... and the output flags of `ddpkit report`."""
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="out_dir of a `ddpkit train` run")
    g = parser.add_argument_group("report")
    g.add_argument(
        "--out", default="report.png", metavar="FILE.png", help="the curves (default: ./report.png)"
    )
    g.add_argument("--html", metavar="FILE.html", help="also write one self-contained HTML page")
    g.add_argument("--json", metavar="FILE.json", help="also write the table and the plotted data as JSON")
    g.add_argument("--target", type=float, metavar="ACC", help="val_acc1 to reach, in (0, 1], e.g. 0.98")
    add_force_flag(g)


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def report_command(cfg, args) -> int:
    """`ddpkit report RUN_DIR ...`: PNG (+ HTML, JSON), and the Markdown table on stdout."""
    target = args.target
    if target is not None and not 0 < target <= 1:
        raise UserError(f"--target {target} is not in (0, 1]", "accuracies are fractions, e.g. --target 0.98")
    outs = [
        check_output(args.out, ".png", "--out", args.force),
        check_output(args.html, ".html", "--html", args.force),
        check_output(args.json, ".json", "--json", args.force),
    ]
    paths = [Path(d).resolve() for d in args.run_dirs]
    if len(set(paths)) < len(paths):
        raise UserError("the same run directory is given twice", "name each run once")
    runs = [load_run(d, warn=_stderr) for d in args.run_dirs]
    keys = differing_keys(runs)
    names = labels(runs, keys)
    summary = [summarize(r, n, keys, target) for r, n in zip(runs, names, strict=True)]
    head, body = table(summary, target)
    png = png_bytes(figure(runs, names, target))
    write_bytes(outs[0], png)
    if outs[1] is not None:
        write_bytes(outs[1], html_page(png, head, body, runs, names).encode("utf-8"))
    if outs[2] is not None:
        doc = {"generated_by": "ddpkit report", "target": target, "differing_keys": keys, "runs": summary}
        write_bytes(outs[2], (json.dumps(doc, indent=2) + "\n").encode("utf-8"))
    print(markdown(head, body))
    print(
        f"\ncurves: {outs[0]}"
        + "".join(f"\n{kind}: {p}" for kind, p in zip(("html", "json"), outs[1:], strict=True) if p)
    )
    return 0
