"""Time every collective like nccl-tests: time per call after warm-up, algbw and busbw (what `ddpkit comm` runs
second), beside the memory-copy bandwidth of the same run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.diagnostics.collective_check import DTYPES, all_gather_flat, reduce_scatter_flat, sync
from ddpkit.distributed.collectives import all_reduce_mean, barrier
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import first_line

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw x factor(n ranks)
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
SPLIT_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # the buffer is cut into one chunk per rank


def _bench_call(op: str, count: int, n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], Any]:
    """One call of `op` on a message of `count` elements (nccl-tests' size), buffers allocated once."""

    def buf(k: int) -> torch.Tensor:
        return torch.ones(k, dtype=dtype, device=device)

    full = buf(count)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    if op == "all_gather":
        part = buf(count // n)
        return lambda: all_gather_flat(full, part)
    if op == "reduce_scatter":
        part = buf(count // n)
        return lambda: reduce_scatter_flat(part, full)
    out, me = buf(count), dist.get_rank()
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(out, full)
    # send_recv: to the next rank and from the previous one at once, grouped as nccl-tests does
    pair = [dist.P2POp(dist.isend, full, (me + 1) % n), dist.P2POp(dist.irecv, out, (me - 1) % n)]
    return lambda: [w.wait() for w in dist.batch_isend_irecv(pair)]


def time_per_call(call: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per call after `warmup` calls, averaged over ranks as nccl-tests does."""
    for _ in range(warmup):
        call()
    sync(device)
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync(device)
    return all_reduce_mean((time.perf_counter() - t0) / iters)


@dataclass
class BenchRow:
    """One operation at one message size."""

    op: str
    bytes: int
    count: int
    time_us: float
    algbw_GBps: float
    busbw_GBps: float


def run_benchmark(
    ctx: DistContext, ops: list[str], sizes: list[int], dtype_name: str, iters: int, warmup: int
) -> tuple[list[BenchRow], dict[str, str], dict[str, float]]:
    """The sweep: rows, ops that could not run (with why), and the memory-copy bandwidth of the largest size."""
    n, dtype, device = ctx.world_size, DTYPES[dtype_name], ctx.device
    elem = torch.tensor([], dtype=dtype).element_size()
    rows: list[BenchRow] = []
    skipped: dict[str, str] = {}
    for op in ops:
        if op == "send_recv" and n < 2:
            skipped[op] = "needs 2 ranks"
            continue
        for size in sizes:
            count = size // elem // n * n if op in SPLIT_OPS else size // elem
            if count == 0:
                continue
            try:
                t = time_per_call(_bench_call(op, count, n, dtype, device), iters, warmup, device)
            except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
                skipped[op] = f"{type(e).__name__}: {first_line(e)}"
                break
            algbw = count * elem / t / 1e9
            rows.append(BenchRow(op, count * elem, count, t * 1e6, algbw, algbw * BUS_FACTOR[op](n)))
    count = max(1, max(sizes) // elem)
    src = torch.ones(count, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), iters, warmup, device)
    memcpy = {"bytes": count * elem, "time_us": t * 1e6, "GBps": count * elem / t / 1e9}
    return rows, skipped, memcpy
