"""After a user's script ends: a launcher said there were several processes, but the script never created a
process group, so each process ran the whole job alone (N independent copies). torchrun says nothing; ddpkit
says it once (rank 0), in one line, with the fix."""

from __future__ import annotations

import os
import sys


def made_group() -> bool:
    """Whether this process ever created a torch.distributed process group (one destroyed since counts):
    init_process_group leaves its `[rankN]:` traceback hook on sys.excepthook."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return True
    return "_distributed_excepthook" in getattr(sys.excepthook, "__qualname__", "")


def warn_if_no_group() -> None:
    raw = os.environ.get("WORLD_SIZE", "")
    if not raw.isdigit() or int(raw) < 2 or os.environ.get("RANK", "0") != "0" or made_group():
        return
    print(
        f"ddpkit: warning: WORLD_SIZE={raw} but the script never created a process group: the run was {raw} "
        "independent copies of one process (call torch.distributed.init_process_group() or ddpkit.prepare(), "
        "or pass the script its own flag for it, e.g. --dist-url env://)",
        file=sys.stderr,
        flush=True,
    )
