"""Reading metrics.jsonl without torch: the epoch lines ddpkit wrote, with every other line (foreign text, a
damaged or torn line, one nested too deeply, an epoch that is not a number) skipped and counted, never fatal."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.config.bounded import loads_json

MAX_METRICS_BYTES = 64 << 20  # a run of 10,000 epochs writes about 5 MiB
MAX_LINE_BYTES = 1 << 20


@dataclass
class MetricsLines:
    """The epoch lines of one metrics.jsonl in file order, and the numbers of the lines that were skipped."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)  # each row's 1-based line number
    skipped: list[int] = field(default_factory=list)  # 1-based line numbers
    torn_last: bool = False  # the last line is cut short (a run killed mid-write): not counted as skipped

    def note(self, path: Path) -> str | None:
        """A warning line naming the skipped lines, or None."""
        if not self.skipped:
            return None
        skipped = sorted(self.skipped)
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(self.skipped) > 5 else "")
        n = len(self.skipped)
        return (
            f"ddpkit: warning: '{path}': {n} line{'s' if n > 1 else ''} ({shown}) not ddpkit metrics, skipped"
        )


def epoch_of(row: Any) -> int | None:
    """A metrics line's epoch number (an int >= 1), or None when the line is not one of ddpkit's."""
    epoch = row.get("epoch") if isinstance(row, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 1 else None


def read_lines(path: str | os.PathLike) -> MetricsLines:
    """Every epoch line of `path` (missing: none). OSError when it cannot be read; ValueError when it is larger
    than MAX_METRICS_BYTES."""
    path = Path(path)
    out = MetricsLines()
    if not path.is_file():
        return out
    if path.stat().st_size > MAX_METRICS_BYTES:
        raise ValueError(f"is larger than {MAX_METRICS_BYTES >> 20} MiB")
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError("too long")
            row = loads_json(raw.decode("utf-8"))
        except ValueError:  # not JSON, not UTF-8, nested too deeply
            if i == len(lines):
                out.torn_last = True
            else:
                out.skipped.append(i)
            continue
        if epoch_of(row) is None:
            out.skipped.append(i)
            continue
        out.rows.append(row)
        out.numbers.append(i)
    return out
