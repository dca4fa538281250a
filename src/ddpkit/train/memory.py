"""Measured memory of one rank: the bytes its parameters, gradients and optimizer state hold.

Counted from this rank's own tensors: a DTensor (FSDP2, tensor parallel) by its local shard, a
ZeroRedundancyOptimizer by the state of the parameters this rank updates, and every storage once however many
tensors view it (DDP's gradients as bucket views, FSDP2's padded shards). The trainer measures the parameters
and gradients just before the first optimizer step (zero_grad frees the gradients after it) and the optimizer
state just after it (the optimizers make their state at their first step), and writes the three numbers into
the first metrics line of the run. The process's peak memory (CUDA's max allocated bytes on a GPU, the peak
resident set size on a CPU), the largest over the ranks, goes into every line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ddpkit.distributed.collectives import all_gather_object, is_dist

FIELDS = ("param_bytes_per_rank", "grad_bytes_per_rank", "optim_bytes_per_rank")


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards), each counted once."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        t = local(t)
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        nbytes = storage.nbytes() if key[1] else t.numel() * t.element_size()
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values())


def param_bytes(model: nn.Module) -> int:
    """This rank's parameter bytes."""
    return storage_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """This rank's gradient bytes (0 when the gradients are freed)."""
    return storage_bytes(p.grad for p in model.parameters())


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    for per_param in state.values():
        for value in per_param.values() if isinstance(per_param, dict) else ():
            if isinstance(value, torch.Tensor):
                yield value


def optim_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer-state bytes (a ZeroRedundancyOptimizer: its own partition's)."""
    inner = getattr(
        optimizer, "optim", None
    )  # ZeroRedundancyOptimizer: the local optimizer of this rank's part
    state = inner.state if isinstance(inner, torch.optim.Optimizer) else optimizer.state
    return storage_bytes(_state_tensors(state))


class MemoryProbe:
    """Measures once, around the first optimizer step: before(model), after(optimizer), then fields()."""

    def __init__(self) -> None:
        self.measured: dict[str, int] = {}
        self.done = False

    def before_step(self, model: nn.Module) -> None:
        if not self.done:
            self.measured = {FIELDS[0]: param_bytes(model), FIELDS[1]: grad_bytes(model)}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.done and self.measured:
            self.measured[FIELDS[2]] = optim_bytes(optimizer)
            self.done = True

    def take(self) -> dict[str, int]:
        """The three fields once (for the first metrics line), then nothing."""
        fields, self.measured = (self.measured if self.done else {}), {}
        return fields


# ---- the peak of the whole process (metrics field peak_memory_bytes_per_rank, every line)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's max allocated bytes on a GPU, else its peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def largest_peak_memory(device: torch.device) -> int:
    """The largest peak memory of the ranks (collective when a process group runs)."""
    mine = peak_memory_bytes(device)
    return max(all_gather_object(mine)) if is_dist() else mine


__all__ = [
    "FIELDS",
    "MemoryProbe",
    "grad_bytes",
    "largest_peak_memory",
    "local",
    "optim_bytes",
    "param_bytes",
    "peak_memory_bytes",
    "storage_bytes",
]
