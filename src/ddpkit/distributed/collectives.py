"""Small collective helpers the trainer, the examples and users' scripts share.

Every helper works without an initialised process group too (a single process), so user code calls them
unconditionally. But no helper falls back to one process silently: when a launcher says this process is one of
several (WORLD_SIZE=4, ...) and no process group exists, it raises a UserError saying to call
`ddpkit.init_distributed()` first.
"""

from __future__ import annotations

import contextlib
import os
import random
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.cluster.launchers import world_variables
from ddpkit.errors import UserError


class _Ended:
    """Who this process was in the process group that ddpkit.shutdown() destroyed (None: no group ended)."""

    rank_world: tuple[int, int] | None = None


def launched_world() -> tuple[str, int] | None:
    """(variable, size) when a launcher says this process is one of several, else None."""
    for var in world_variables():
        raw = os.environ.get(var, "").strip()
        if raw.isdigit() and int(raw) > 1:
            return var, int(raw)
    return None


def group_ended(rank: int, world_size: int) -> None:
    """Remember who this process was, for the helpers called after the group is destroyed."""
    _Ended.rank_world = (rank, world_size)


def _ended() -> tuple[int, int] | None:
    """Who this process was in the group shutdown() destroyed. A one-process group that ended does not
    answer a launcher that says this process is one of several: that still needs a group."""
    ended = _Ended.rank_world
    if ended is not None and ended[1] == 1:
        _no_group()
    return ended


def _no_group() -> None:
    launched = launched_world()
    if launched is not None:
        var, n = launched
        raise UserError(
            f"{var}={n} says this process is one of {n}, but no process group is initialised",
            "call ddpkit.init_distributed() or ddpkit.prepare() first, or each process runs alone",
        )


def is_dist() -> bool:
    """True inside an initialised process group; False for a single process; UserError when a launcher
    started several processes but no group was made (or it was already shut down)."""
    if dist.is_available() and dist.is_initialized():
        return True
    if _Ended.rank_world is not None and _Ended.rank_world[1] > 1:
        raise UserError(
            "a collective was called after ddpkit.shutdown() destroyed the process group",
            "call collectives (barrier, reductions, gathers, checkpoints) before shutdown()",
        )
    _no_group()
    return False


def get_rank() -> int:
    """This process's rank (0 in a single process; the last rank after shutdown())."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    ended = _ended()
    if ended is not None:
        return ended[0]
    _no_group()
    return 0


def get_world_size() -> int:
    """The number of processes (1 in a single process; the last world size after shutdown())."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    ended = _ended()
    if ended is not None:
        return ended[1]
    _no_group()
    return 1


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


def _like(value: Any, total: float) -> Any:
    """A sum of integers stays an integer."""
    return int(total) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else total


class _ShapesChecked:
    """The process group whose ranks were found to pass reductions of one shape (checked on the first call)."""

    group: Any = None


def _check_shapes(t: torch.Tensor) -> None:
    """On the first reduction in a group, every rank's shape and dtype must agree: else each rank raises,
    naming the rank that differs, instead of a gloo timeout much later."""
    world = dist.group.WORLD
    if _ShapesChecked.group is world:
        return
    mine = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    _ShapesChecked.group = world
    odd = [r for r, s in enumerate(seen) if s != seen[0]]
    if odd:
        r = odd[0]
        raise UserError(
            f"all_reduce_sum: rank {r} passed shape {list(seen[r][0])} ({seen[r][1]}), rank 0 passed "
            f"{list(seen[0][0])} ({seen[0][1]})",
            "every rank must reduce a value of the same shape at the same call",
        )


def all_reduce_sum(value: Any) -> Any:
    """Sum a tensor, a number, or a list/tuple of numbers over all ranks (returns a new value). The first call
    in a process group checks that every rank passes the same shape."""
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        if is_dist():
            _check_shapes(out)
            moved = out.to(_comm_device())
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            out = moved.to(value.device)
        return out
    if isinstance(value, (list, tuple)):
        t = torch.tensor([float(v) for v in value], dtype=torch.float64)
        sums = all_reduce_sum(t).tolist()
        return type(value)(_like(v, s) for v, s in zip(value, sums, strict=True))
    if isinstance(value, (int, float, np.number, bool)):
        return _like(value, all_reduce_sum(torch.tensor([float(value)], dtype=torch.float64)).item())
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


def gather_object_to(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj` in rank order on rank `dst` only; None on the others (`all_gather_object`: on every
    rank, as `gather` does for tensors and lists)."""
    if not is_dist():
        return [obj]
    out: list[Any] | None = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def gather(value: Any) -> Any:
    """Every rank's `value` joined in rank order, on every rank: tensors along dim 0 (sizes may differ per rank,
    other dims must match), lists concatenated.

    With ddpkit's evaluation loaders (contiguous shards in rank order) the result is in data set order, every
    sample exactly once.
    """
    if isinstance(value, torch.Tensor):
        if not is_dist():
            return value
        device = _comm_device()
        local = value.detach().to(device)
        sizes = all_gather_object(int(local.shape[0]) if local.dim() else 1)
        local = local.reshape(-1, *local.shape[1:]) if local.dim() else local.reshape(1)
        padded = torch.zeros((max(sizes), *local.shape[1:]), dtype=local.dtype, device=device)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).to(value.device)
    if isinstance(value, (list, tuple)):
        return [item for part in all_gather_object(list(value)) for item in part]
    raise TypeError(f"gather takes a tensor or a list, not {type(value).__name__}")


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


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and CUDA) with exactly `seed`.

    deterministic: also make the kernels deterministic (torch.use_deterministic_algorithms, cuDNN without
    autotuning, cuBLAS's fixed workspace), so that a run or a resumed epoch repeats bit for bit on a GPU too
    (on the CPU it does already). Slower on GPUs; an operation without a deterministic kernel then raises.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first use
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def seed_rank(seed: int, rank: int | None = None) -> int:
    """Seed this rank's augmentation/dropout streams with seed + rank (different on every rank); returns it."""
    s = seed + (get_rank() if rank is None else rank)
    seed_everything(s)
    return s
