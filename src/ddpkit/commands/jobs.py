"""What `ddpkit slurm` and `ddpkit k8s` share: the job's shape and names, checked before anything is written."""

from __future__ import annotations

import re

from ddpkit.errors import UserError

DEFAULT_NAME = "ddpkit"


def add_shape_flags(g) -> None:
    """--nodes and --gpus-per-node on an argparse group."""
    g.add_argument("--nodes", type=int, default=1, metavar="N", help="number of nodes (pods)")
    g.add_argument("--gpus-per-node", type=int, default=1, metavar="G", help="GPUs per node; one rank each")


def check_shape(nodes: int, gpus: int) -> None:
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}", "use e.g. --nodes 2")
    if gpus < 0:
        raise UserError(
            f"--gpus-per-node must be 0 or more, got {gpus}", "use e.g. --gpus-per-node 8 (0 for CPU nodes)"
        )


def check_name(flag: str, name: str, pattern: re.Pattern[str], allowed: str) -> None:
    if not pattern.fullmatch(name):
        raise UserError(f"{flag} '{name}' is not a valid name", f"use {allowed}")
