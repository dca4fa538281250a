"""What this machine has: its physical memory (the bound every size estimate is checked against)."""

from __future__ import annotations

import os


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
