"""Why a checkpoint file could not be read, in a few words: what the full-state reader (checkpoint/__init__.py) and
the sharded one (sharded.py) both say. A leaf: it imports no other checkpoint module."""

from __future__ import annotations

import re

from ddpkit.errors import first_line


def unreadable_reason(e: BaseException) -> str:
    """Why torch.load(weights_only=True) failed, in a few words (torch's own message is long and its advice,
    loading with weights_only=False, is wrong for a file from elsewhere)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        name = found.group(1)
        what = "a pickled model object" if name.startswith("torch.nn.") else "Python objects"
        return f"it holds {what} (GLOBAL {name}) that a safe load refuses to run"
    if isinstance(e, EOFError):
        return "it ends before its data does (empty or cut short)"
    for needle, reason in (
        ("central directory", "it is truncated or damaged (its zip directory is missing)"),
        ("Unsupported operand", "it is not a torch.save file (not a pickle torch can read)"),
        ("magic number", "it is not a torch.save file (wrong magic number)"),
        ("invalid load key", "it is not a torch.save file"),
    ):
        if needle in text:
            return reason
    return f"{type(e).__name__}: {first_line(text, limit=70)}"
