"""The docs' language-model command lines, each run as written: the wall time of the whole command, the load average
before it, the CPU other processes used meanwhile, and the run's last validation loss (metrics.jsonl).

Every `ddpkit train -c configs/text_*.yaml ...` line of README.md and docs/*.md (but the one on the reader's own
token files and GPT-2 folder) is run, one after another, in an
empty folder of its own where configs/ is this repository's (so `-c configs/...` and the default out_dir resolve as
in a checkout). The promise measured: each runs on a 2-core CPU machine in under 5 minutes (docs/language-model.md).

    python benchmarks/lm_doc_lines.py                         # every line: about 30 to 60 minutes on 2 cores
    python benchmarks/lm_doc_lines.py --only hsdp --only qwen3  # the lines holding one of these words
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, RunFailed, machine, machine_line, md_table, python, read_jsonl, run_measured  # noqa: E402

LINE = re.compile(r"^(ddpkit train -c configs/text_\w+\.yaml.*?)(?:\s+#.*)?$")
BUDGET_S = 300
# a line that reads the reader's own files (the token files and GPT-2 folder the docs make by hand) is left out
NEEDS_FILES = re.compile(r"\b(model\.init_from|data\.root)=")


def doc_lines() -> list[str]:
    """The language-model training lines of the docs, in the order they are shown, each once."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found: list[str] = []
    for doc in docs:
        for line in doc.read_text().splitlines():
            m = LINE.match(line.strip())
            if m and m.group(1) not in found and not NEEDS_FILES.search(m.group(1)):
                found.append(m.group(1))
    return found


def run_line(line: str) -> list[object]:
    """One line in an empty folder: [line, wall s, load before, other cores, last val_loss, verdict]."""
    words = shlex.split(line)
    assert words[0] == "ddpkit", line
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "configs").symlink_to(ROOT / "configs")
        cmd = [python(), "-m", "ddpkit", *words[1:]]
        try:  # in the empty folder: its runs/ is the line's own, never an earlier line's run to resume
            r = run_measured(cmd, line, cwd=Path(tmp))
        except RunFailed as e:
            return [f"`{line}`", "-", "-", "-", "-", f"failed (exit {e.rc})"]
        rows = [row for m in Path(tmp, "runs").glob("*/metrics.jsonl") for row in read_jsonl(m)]
    val = f"{rows[-1]['val_loss']:.3f}" if rows else "-"
    verdict = "under 5 min" if r["wall_s"] < BUDGET_S else "OVER 5 min"
    other = f"{r['other_cores']:.1f}" if r["other_cores"] is not None else "-"
    return [f"`{line}`", f"{r['wall_s']:.0f}", f"{r['load1']:.1f}", other, val, verdict]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[], help="run only the lines holding this text")
    args = p.parse_args(argv)
    lines = [ln for ln in doc_lines() if not args.only or any(w in ln for w in args.only)]
    m = machine()
    table = []
    for line in lines:
        table.append(run_line(line))
        print("  " + " | ".join(str(c) for c in table[-1]), flush=True)
    print()
    print(f"Machine: {machine_line(m)}")
    print("Command: python benchmarks/lm_doc_lines.py " + " ".join(f"--only {w}" for w in args.only))
    print()
    headers = ["line", "wall s", "load before", "other cores", "last val_loss", "verdict"]
    print(md_table(headers, table))


if __name__ == "__main__":
    main()
