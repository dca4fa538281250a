"""Small collective helpers the trainer, the examples and `ddpkit comm` share.

Every helper works without an initialised process group too (a single process), so user code calls them
unconditionally.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    """True on global rank 0 (and in a single process)."""
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block first (download, unpack, cache); the others wait, then run it."""
    if not is_main_process():
        barrier()
    try:
        yield
    finally:
        if is_main_process():
            barrier()


def _comm_device() -> torch.device:
    """Where reduction buffers live: the current GPU for nccl, the CPU otherwise."""
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(value: Any) -> Any:
    """Sum a tensor, a number, or a list/tuple of numbers over all ranks (returns a new value)."""
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        if is_dist():
            moved = out.to(_comm_device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            out = moved.to(value.device)
        return out
    if isinstance(value, (list, tuple)):
        t = torch.tensor([float(v) for v in value], dtype=torch.float64)
        return type(value)(all_reduce_sum(t).tolist())
    if isinstance(value, (int, float, np.number, bool)):
        t = torch.tensor([float(value)], dtype=torch.float64)
        s = all_reduce_sum(t).item()
        return int(s) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else s
    raise TypeError(
        f"all_reduce_sum takes a tensor, a number or a list of numbers, not {type(value).__name__}"
    )


def all_reduce_mean(value: Any) -> Any:
    """Mean over ranks of a tensor, number, or list of numbers."""
    n = get_world_size()
    s = all_reduce_sum(value)
    if isinstance(s, torch.Tensor):
        return s / n if s.is_floating_point() else s.double() / n
    if isinstance(s, (list, tuple)):
        return type(s)(v / n for v in s)
    return s / n


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (of `group`, default: all ranks)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj` in rank order on `dst`; None elsewhere."""
    if not is_dist():
        return [obj]
    out: list[Any] | None = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`src`'s obj on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def derive_seed(seed: int, *parts: int) -> int:
    """A well-mixed 31-bit seed from a base seed and e.g. (rank, epoch)."""
    data = ",".join(str(int(p)) for p in (seed, *parts)).encode()
    return zlib.crc32(data) & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) with exactly `seed`."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def seed_model_init(seed: int) -> None:
    """Same seed on every rank, so every rank builds identical initial weights."""
    seed_everything(seed)


def seed_rank(seed: int, rank: int | None = None) -> int:
    """Seed this rank's augmentation/dropout streams with seed + rank (different on every rank); returns it."""
    s = seed + (get_rank() if rank is None else rank)
    seed_everything(s)
    return s
