"""One run directory read back: its epochs from metrics.jsonl (each line checked, the lines of a resumed run
reconciled) and its flattened config.yaml (`Run`, `load_run`). No picture here (drawing.py draws a Run)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.config.bounded import read_yaml_file
from ddpkit.errors import UserError
from ddpkit.train.metrics_file import NUMERIC, read_lines

MAX_METRICS_BYTES = 64 << 20
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_KEYS = 10_000
_PLOTTED = ("lr", "train_loss", "train_acc1", "val_loss", "val_acc1", "val_acc5", "train_images_per_s")
_PLOTTED_LM = ("val_ppl", "train_tokens_per_s")  # in the JSON of language-model runs only


@dataclass
class Run:
    """One run directory: its epochs (one row each, by epoch), where it resumed, and its flattened config."""

    path: Path
    rows: list[dict[str, Any]]
    resumed_after: list[int] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""

    def series(self, key: str) -> list[Any]:
        return [r.get(key) for r in self.rows]

    def sizes(self, key: str) -> str:
        """world_size / global_batch_size over the run: one value, or the values in order (`1->2`)."""
        seen: list[Any] = []
        for v in self.series(key):
            if v is not None and v not in seen:
                seen.append(v)
        return "->".join(str(v) for v in seen) if seen else "?"


def _bad(path: Path, what: str) -> UserError:
    return UserError(f"'{path}' {what}", "pass the out_dir of a `ddpkit train` run that finished an epoch")


def _read_rows(path: Path, warn=None) -> tuple[list[dict[str, Any]], list[int]]:
    """metrics.jsonl -> (rows, one row per epoch, later wins; epochs after which the run resumed: where a line
    says so in `resumed_after`, or where the numbering went back).
    Lines that are not ddpkit's epoch lines (foreign, damaged, a non-number where a number goes) are skipped
    and counted in one warning through `warn`."""
    try:
        lines = read_lines(path)
    except (OSError, ValueError) as e:
        raise _bad(path, f"cannot be read: {getattr(e, 'strerror', None) or e}") from None
    by_epoch: dict[int, dict[str, Any]] = {}
    restarts: list[int] = []
    last = 0
    not_finite: dict[int, list[str]] = {}
    for row, number in zip(lines.rows, lines.numbers, strict=True):
        if any(_not_number(row.get(key)) for key in NUMERIC):
            lines.skipped.append(number)
            continue
        if names := _not_finite(row):
            not_finite[number] = names
            row = {k: (None if k in names else v) for k, v in row.items()}
        epoch = row["epoch"]
        if epoch <= last:
            restarts.append(epoch - 1)
        if isinstance(row.get("resumed_after"), int):
            restarts.append(row["resumed_after"])
        last = epoch
        by_epoch[epoch] = row
    if not by_epoch:
        n = len(lines.skipped)
        raise _bad(
            path, "holds no epoch yet" + (f" ({n} line(s) that are not ddpkit metrics skipped)" if n else "")
        )
    note = lines.note(path)
    if note and warn is not None:
        warn(note)
    if not_finite and warn is not None:
        warn(_not_finite_note(path, not_finite))
    return [by_epoch[e] for e in sorted(by_epoch)], restarts


def _not_finite(row: dict[str, Any]) -> list[str]:
    """The numeric fields of `row` holding NaN or Infinity (JSON's NaN/Infinity spellings read as floats)."""
    return [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]


def _not_finite_note(path: Path, where: dict[int, list[str]]) -> str:
    numbers = sorted(where)
    fields = sorted({name for names in where.values() for name in names})
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return (
        f"ddpkit: warning: '{path}': NaN or Infinity in {', '.join(fields)} on line(s) {shown} "
        "(the loss diverged there?); those values are left out of the table and curves"
    )


def _not_number(v: Any) -> bool:
    return v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))


def flatten(tree: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """A nested mapping as dotted keys; UserError past MAX_CONFIG_KEYS (YAML aliases can multiply a small file)."""
    out = {} if out is None else out
    if isinstance(tree, dict):
        for k, v in tree.items():
            flatten(v, f"{prefix}{k}.", out)
    else:
        out[prefix[:-1]] = tree
    if len(out) > MAX_CONFIG_KEYS:
        raise UserError(
            f"config.yaml under '{prefix or '.'}' has over {MAX_CONFIG_KEYS} keys", "not a ddpkit config"
        )
    return out


def _read_config(path: Path) -> tuple[dict[str, Any], str]:
    """A run's config.yaml through the bounded reader (size, aliases, nesting): flattened, and its text."""
    if not path.is_file():
        raise _bad(path.parent, "has no config.yaml")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise _bad(path, f"is larger than {MAX_CONFIG_BYTES >> 20} MiB; not a ddpkit config")
    tree = read_yaml_file(path, f"'{path}'", "pass the out_dir of a `ddpkit train` run")
    if not isinstance(tree, dict):
        raise _bad(path, "is not a YAML mapping")
    return flatten(tree), path.read_text(encoding="utf-8", errors="replace")


def load_run(path: str | os.PathLike, with_config: bool = True, warn=None) -> Run:
    """Read one run directory; UserError when it is not one; `warn(line)` hears of skipped metrics lines."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"run directory '{path}' does not exist", "pass the out_dir of a `ddpkit train` run")
    if not path.is_dir():
        raise UserError(f"'{path}' is not a directory", "pass the out_dir of a `ddpkit train` run")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise _bad(path, "has no metrics.jsonl")
    rows, restarts = _read_rows(metrics, warn)
    last = rows[-1]["epoch"]
    resumed = sorted({e for e in restarts if 1 <= e < last})
    config, text = _read_config(path / "config.yaml") if with_config else ({}, "")
    return Run(path, rows, resumed, config, text)
