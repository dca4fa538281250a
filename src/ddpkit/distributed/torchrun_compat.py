"""torchrun's and mpirun's spellings of the launch flags, for every command that starts workers.

- Every launch flag in both spellings: `--nproc-per-node` and `--nproc_per_node`, `--master-addr` and
  `--master_addr`, ... (torchrun accepts both).
- `--nproc-per-node auto|cpu|gpu|N` with torchrun's meanings: `gpu` one per visible GPU, `cpu` one per CPU core,
  `auto` one per GPU when there is one, else one per core.
- `--standalone`: one node, a free local port (what ddpkit does anyway with one node and no address).
- `--oversubscribe` (mpirun's word): more CPU processes than cores is meant, as DDPKIT_OVERSUBSCRIBE=1.
"""

from __future__ import annotations

import argparse
import os

from ddpkit import channels
from ddpkit.errors import UserError

# Flags that take no value (a starter flag: the workers never see it).
NO_VALUE = frozenset({"--standalone", "--oversubscribe"})
NPROC_WORDS = ("auto", "cpu", "gpu")


def underscored(flag: str) -> str:
    return "--" + flag[2:].replace("-", "_")


def both_spellings(flag: str) -> tuple[str, ...]:
    """(`--a-b`, `--a_b`): the argparse option strings of one launch flag."""
    alt = underscored(flag)
    return (flag,) if alt == flag else (flag, alt)


def spellings(starter: frozenset[str], launch: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
    """The flag sets with the underscore spellings and the value-less flags added."""
    starter = starter | {underscored(f) for f in starter} | NO_VALUE
    launch = launch | {underscored(f) for f in launch} | starter
    return frozenset(starter), frozenset(launch)


def nproc_value(text: str) -> int | str:
    """argparse type of --nproc-per-node: a whole number >= 1 or one of auto, cpu, gpu."""
    if text in NPROC_WORDS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a number or one of {', '.join(NPROC_WORDS)}, got '{text}'"
        ) from None


def resolve_nproc(value: int | str | None) -> int | None:
    """torchrun's meaning of auto / cpu / gpu; numbers as given."""
    if not isinstance(value, str):
        return value
    if value == "cpu":
        return os.cpu_count() or 1
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if value == "gpu":
        if not gpus:
            raise UserError(
                "--nproc-per-node gpu: this host has no usable GPU",
                "use --nproc-per-node cpu, auto or a number",
            )
        return gpus
    return gpus or (os.cpu_count() or 1)


def add_flags(group) -> None:
    group.add_argument(
        "--standalone",
        action="store_true",
        help="one node on a free local port, as torchrun --standalone (ddpkit's default with one node)",
    )
    group.add_argument(
        "--oversubscribe",
        action="store_true",
        help=f"allow more CPU processes than cores on a node (as {channels.OVERSUBSCRIBE}=1)",
    )


def apply(args: argparse.Namespace) -> None:
    """Resolve the torchrun-only spellings in parsed launch flags (in place)."""
    args.nproc_per_node = resolve_nproc(args.nproc_per_node)
    if getattr(args, "oversubscribe", False):
        os.environ[channels.OVERSUBSCRIBE] = "1"  # this launcher's check, and its workers', read it
    if getattr(args, "standalone", False):
        if args.nnodes != 1 or args.rdzv_endpoint or args.master_addr:
            raise UserError(
                "--standalone runs one node on a local port",
                "drop --standalone, or drop --nnodes/--master-addr/--rdzv-endpoint",
            )
        if args.nproc_per_node is None:
            args.nproc_per_node = 1  # torchrun --standalone SCRIPT starts one worker
