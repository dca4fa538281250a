"""The pictures and the page of `ddpkit report`: curves over epochs (matplotlib, imported here only), PNG bytes
and a self-contained HTML page. A language model's runs get perplexity and tokens/s panels."""

from __future__ import annotations

import base64
import html
import io
import itertools
import math
from typing import TYPE_CHECKING, Any

from ddpkit.commands.outputs import MARKER

if TYPE_CHECKING:
    from ddpkit.commands.report import Run

FIG_SIZE_IN = (12.0, 8.0)
FIG_DPI = 100  # so a report PNG is 1200 x 800 pixels


def finite(v: Any) -> Any:
    """`v`, or None for a NaN or an infinity (JSON and the plots have no place for them)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def is_language_model(run: Run) -> bool:
    """Whether the run is a language model's (its lines have perplexities and no accuracies)."""
    return any(r.get("val_ppl") is not None or r.get("train_tokens_per_s") is not None for r in run.rows)


def panels(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """The four panels (title, fields): accuracy and images/s, or for language models perplexity and tokens/s."""
    lm = bool(runs) and all(is_language_model(r) for r in runs)
    return [
        ("loss (solid: train, dashed: val)", ["train_loss", "val_loss"]),
        ("val perplexity", ["val_ppl"]) if lm else ("val accuracy (top-1)", ["val_acc1"]),
        ("learning rate (end of epoch)", ["lr"]),
        ("training tokens/s", ["train_tokens_per_s"])
        if lm
        else ("training images/s", ["train_images_per_s"]),
    ]


def figure(runs: list[Run], names: list[str], target: float | None = None, title: str = ""):
    """Four panels over epochs: loss, val accuracy (perplexity), lr, images/s (tokens/s); one colour per run, a
    break where it resumed."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=FIG_SIZE_IN, dpi=FIG_DPI)  # fixed margins: a layout engine would double the time
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.15, top=0.92, hspace=0.38, wspace=0.16)
    axes = fig.subplots(2, 2).ravel()
    shown = panels(runs)
    for ax, (name, _) in zip(axes, shown, strict=True):
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for i, (run, name) in enumerate(zip(runs, names, strict=True)):
        color = f"C{i % 10}"
        cuts = [0, *run.resumed_after, math.inf]
        segments = [[r for r in run.rows if lo < r["epoch"] <= hi] for lo, hi in itertools.pairwise(cuts)]
        for ax, (_, keys) in zip(axes, shown, strict=True):
            for key, style in zip(keys, ["-", "--"][: len(keys)], strict=True):
                for seg in segments:
                    pts = [(r["epoch"], r[key]) for r in seg if finite(r.get(key)) is not None]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            style,
                            color=color,
                            marker="o",
                            markersize=3,
                            linewidth=1.5,
                        )
            for e in run.resumed_after:
                ax.axvline(e + 0.5, color=color, linestyle=":", linewidth=1, alpha=0.5)
        resumed = (
            f" (resumed after epoch {', '.join(map(str, run.resumed_after))})" if run.resumed_after else ""
        )
        axes[0].plot([], [], "-", color=color, marker="o", label=name + resumed)
    if target is not None:
        axes[1].axhline(target, color="gray", linestyle="--", linewidth=1)
    fig.legend(loc="lower center", ncols=min(len(runs), 3), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def png_bytes(fig) -> bytes:
    """Render a matplotlib Figure (no pyplot, no global backend) to PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIG_DPI, metadata={"Software": f"{MARKER} (matplotlib)"})
    return buf.getvalue()


def html_page(png: bytes, head: list[str], body: list[list[str]], runs: list[Run], names: list[str]) -> str:
    """One self-contained HTML file: the picture inline, the table, each run's config; no scripts, no links."""
    e = html.escape
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in body)
    configs = "".join(
        f"<details><summary>{e(name)} &mdash; {e(str(r.path))}</summary><pre>{e(r.config_text)}</pre></details>"
        for r, name in zip(runs, names, strict=True)
    )
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #bbb;padding:4px 8px;text-align:left}img{max-width:100%}"
    )
    return (
        f'<!DOCTYPE html>\n<!-- {MARKER} report -->\n<html lang="en"><head><meta charset="utf-8"><title>ddpkit report</title>'
        f"<style>{style}</style></head><body><h1>ddpkit report</h1>"
        f'<img alt="training curves" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        f"<h2>Runs</h2><table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"
        f"<h2>Configs</h2>{configs}</body></html>\n"
    )
