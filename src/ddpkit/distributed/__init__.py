"""The process group: backend and device choice and init_process_group (runtime), by-hand rendezvous
(rendezvous), and the collective helpers users' scripts and the trainer share (collectives).

Names load on first use (PEP 562), so `import ddpkit.distributed` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# the collectives helpers the top-level package exports too (derive_seed stays here)
COLLECTIVES = (
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "gather",
    "gather_object_to",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "rank_zero_first",
    "seed_everything",
    "seed_rank",
)

_WHERE = {
    **dict.fromkeys((*COLLECTIVES, "derive_seed"), "ddpkit.distributed.collectives"),
    **dict.fromkeys(("DistEnv", "detect_env"), "ddpkit.cluster.env"),
    **dict.fromkeys(("expand_nodelist", "parse_nodelist"), "ddpkit.cluster.slurm_env"),
    **dict.fromkeys(
        ("DistContext", "init_distributed", "resolve_device_backend", "shutdown"),
        "ddpkit.distributed.runtime",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ddpkit.distributed' has no attribute {name!r}")


__all__ = sorted(_WHERE)
