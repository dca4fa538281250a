"""`CompressionMethod`: what one dist.grad_compression value is (its hook and the checkpoint state the hook
owns) and PowerSGD's config keys. Its own module so that a method's module (powersgd.py) and the registry (compression.py) both import it
and neither imports the other at its top. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit.config.schema import opt


def _no_restore(saved: list[dict], rank: int, world_size: int) -> tuple[dict | None, str | None]:
    return (saved[rank] if len(saved) == world_size else None), None


@dataclass(frozen=True)
class CompressionMethod:
    """One dist.grad_compression value.

    `register(ddp, options) -> holder`: registers the hook on a DistributedDataParallel module (options: the
    `Compression` value: powersgd_rank, ...) and returns what holds its state (None when stateless);
    `state_dict(holder)` / `load_state_dict(holder, saved, device)`: that state in a checkpoint (one per rank);
    `restore(saved_per_rank, rank, world_size) -> (state or None, message or None)`: what this rank takes from
    a checkpoint saved on `len(saved_per_rank)` ranks (and a line to log when some of it is dropped);
    `keys`: the method's own config keys, a dataclass of `opt()` fields added to the `dist` section
    (`dist.powersgd_rank`), documented under the method in --help-config.
    """

    name: str
    summary: str
    register: Callable[[Any, Any], Any]
    state_dict: Callable[[Any], dict | None] = lambda holder: None
    load_state_dict: Callable[[Any, dict, Any], None] = lambda holder, saved, device: None
    restore: Callable[[list[dict], int, int], tuple[dict | None, str | None]] = _no_restore
    keys: type | None = None


@dataclass
class PowerSGDKeys:
    """PowerSGD's low-rank approximation."""

    powersgd_rank: int = opt(1, "PowerSGD's matrix approximation rank (more: closer, more bytes)", gt=0)
    powersgd_warmup_steps: int = opt(
        10, "optimizer steps of exact all-reduce before PowerSGD starts compressing (at least 2)", ge=2
    )
