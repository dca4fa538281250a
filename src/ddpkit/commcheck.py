"""`ddpkit comm`: check every collective against closed-form values, then measure bandwidth like nccl-tests.

1. Check: each operation runs on the default group, with `async_op=True`, and on a `new_group` of the even
   ranks, on CPU tensors (and GPU tensors when the device is cuda). Every rank compares its result with the
   value computed in closed form; the ranks then agree, over a separate gloo control group, on ok / WRONG /
   unsupported (every rank raised the same error: discovered by trying) / error (ranks failed differently:
   the check stops there, since the group can no longer be trusted).
2. Benchmark: time per call after warm-up, averaged over ranks, for doubling message sizes; algbw = size / time
   and busbw = algbw x nccl-tests' factor; a tensor copy of the largest size in the same run gives the
   memory-copy bandwidth the all_reduce bus bandwidth is compared with.

Test hook: DDPKIT_COMM_TAMPER=OP[,OP...] corrupts one expected value of OP (the check must say WRONG);
`OP:raise` makes OP raise on every rank (unsupported) and `OP:raise@R` only on rank R (error).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.comm import all_gather_object, all_reduce_mean, barrier
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError

TAMPER_ENV = "DDPKIT_COMM_TAMPER"
CHUNK = 5  # elements each rank contributes to a checked operation
FULL = (1 << 62) - 1  # 62 one-bits: the bitwise reductions' universe
DEFAULT_SIZES = "4K-256M"
# torch 2.14 renamed the flat-buffer collectives (the old names warn); older versions have only the old names
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}

# -------------------------------------------------------------------------------------------- the check

Values = list[int]


@dataclass(frozen=True)
class Case:
    """One way of running an operation: which group, where its tensors live, sync or async."""

    group: Any  # None: the default group
    ranks: tuple[int, ...]  # the group's global ranks, in group-rank order
    device: torch.device
    async_op: bool

    @property
    def n(self) -> int:
        return len(self.ranks)

    @property
    def g(self) -> int:
        return self.ranks.index(dist.get_rank())

    def tensor(self, values: Values, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def empty(self, count: int = CHUNK) -> torch.Tensor:
        return torch.full((count,), -1.0, device=self.device)

    def wait(self, work: Any) -> None:
        if work is not None:  # async_op=True returns a Work handle
            work.wait()


# got, expected: what a check hands back for comparison (None: not applicable to this case)
Outcome = list[tuple[torch.Tensor, Values]] | None


def _row(r: int) -> Values:
    """The chunk that rank r owns (broadcast, gather, scatter)."""
    return [100 * r + j + 1 for j in range(CHUNK)]


def _cell(src: int, dst: int) -> Values:
    """The chunk that rank src sends to rank dst in all_to_all."""
    return [10000 * src + 100 * dst + j + 1 for j in range(CHUNK)]


def _concat(chunks: Any) -> Values:
    return [v for chunk in chunks for v in chunk]


def _ring_bits(n: int, j: int) -> int:
    """OR over ranks r < n of 1 << (r + j) % 62."""
    return sum(1 << (j + k) % 62 for k in range(min(n, 62)))


# name: (ReduceOp, dtype, rank r's element j, the closed-form result over n ranks at j)
REDUCTIONS: dict[str, tuple[str, torch.dtype, Callable[[int, int], int], Callable[[int, int], int]]] = {
    "sum": ("SUM", torch.float32, lambda r, j: r + 1 + j, lambda n, j: n * (n + 1) // 2 + n * j),
    "product": (
        "PRODUCT",
        torch.float32,
        lambda r, j: 2 if (r + j) % 3 == 0 else 1,
        lambda n, j: 2 ** len(range(-j % 3, n, 3)),
    ),
    "min": ("MIN", torch.float32, lambda r, j: (r + 1) * (j + 1), lambda n, j: j + 1),
    "max": ("MAX", torch.float32, lambda r, j: (r + 1) * (j + 1), lambda n, j: n * (j + 1)),
    "band": (
        "BAND",
        torch.int64,
        lambda r, j: FULL ^ 1 << (r + j) % 62,
        lambda n, j: FULL ^ _ring_bits(n, j),
    ),
    "bor": ("BOR", torch.int64, lambda r, j: 1 << (r + j) % 62, _ring_bits),
    "bxor": (
        "BXOR",
        torch.int64,
        lambda r, j: r + 1 + (j << 20),
        lambda n, j: (n, 1, n + 1, 0)[n % 4] ^ (j << 20) * (n % 2),
    ),
}


def _reduction_io(kind: str, c: Case) -> tuple[torch.Tensor, Values, Any]:
    """This rank's input tensor, the closed-form result, and the ReduceOp for reduction `kind`."""
    op, dtype, x, result = REDUCTIONS[kind]
    mine = c.tensor([x(c.g, j) for j in range(CHUNK)], dtype)
    return mine, [result(c.n, j) for j in range(CHUNK)], getattr(dist.ReduceOp, op)


def _all_reduce(kind: str) -> Callable[[Case], Outcome]:
    def check(c: Case) -> Outcome:
        t, want, op = _reduction_io(kind, c)
        c.wait(dist.all_reduce(t, op=op, group=c.group, async_op=c.async_op))
        return [(t, want)]

    return check


def _reduce(c: Case) -> Outcome:
    dst = c.n - 1
    t, want, op = _reduction_io("sum", c)
    c.wait(dist.reduce(t, dst=c.ranks[dst], op=op, group=c.group, async_op=c.async_op))
    return [(t, want)] if c.g == dst else []


def _broadcast(c: Case) -> Outcome:
    src = c.n - 1
    t = c.tensor(_row(src)) if c.g == src else c.empty()
    c.wait(dist.broadcast(t, src=c.ranks[src], group=c.group, async_op=c.async_op))
    return [(t, _row(src))]


def _all_gather(flat: bool) -> Callable[[Case], Outcome]:
    def check(c: Case) -> Outcome:
        mine, kw = c.tensor(_row(c.g)), {"group": c.group, "async_op": c.async_op}
        if flat:
            got = c.empty(c.n * CHUNK)
            c.wait(all_gather_flat(got, mine, **kw))
        else:
            parts = [c.empty() for _ in range(c.n)]
            c.wait(dist.all_gather(parts, mine, **kw))
            got = torch.cat(parts)
        return [(got, _concat(_row(k) for k in range(c.n)))]

    return check


def _gather(c: Case) -> Outcome:
    dst = c.n - 1
    parts = [c.empty() for _ in range(c.n)] if c.g == dst else None
    c.wait(dist.gather(c.tensor(_row(c.g)), parts, dst=c.ranks[dst], group=c.group, async_op=c.async_op))
    return [(torch.cat(parts), _concat(_row(k) for k in range(c.n)))] if parts is not None else []


def _scatter(c: Case) -> Outcome:
    parts = [c.tensor(_row(k)) for k in range(c.n)] if c.g == 0 else None
    got = c.empty()
    c.wait(dist.scatter(got, parts, src=c.ranks[0], group=c.group, async_op=c.async_op))
    return [(got, _row(c.g))]


def _reduce_scatter(flat: bool) -> Callable[[Case], Outcome]:
    def check(c: Case) -> Outcome:
        parts = [c.tensor([(c.g + 1) * v for v in _row(k)]) for k in range(c.n)]
        got, kw = c.empty(), {"op": dist.ReduceOp.SUM, "group": c.group, "async_op": c.async_op}
        if flat:
            c.wait(reduce_scatter_flat(got, torch.cat(parts), **kw))
        else:
            c.wait(dist.reduce_scatter(got, parts, **kw))
        return [(got, [c.n * (c.n + 1) // 2 * v for v in _row(c.g)])]

    return check


def _all_to_all(flat: bool) -> Callable[[Case], Outcome]:
    def check(c: Case) -> Outcome:
        parts, kw = [c.tensor(_cell(c.g, k)) for k in range(c.n)], {"group": c.group, "async_op": c.async_op}
        if flat:
            got = c.empty(c.n * CHUNK)
            c.wait(dist.all_to_all_single(got, torch.cat(parts), **kw))
        else:
            outs = [c.empty() for _ in range(c.n)]
            c.wait(dist.all_to_all(outs, parts, **kw))
            got = torch.cat(outs)
        return [(got, _concat(_cell(k, c.g) for k in range(c.n)))]

    return check


def _barrier(c: Case) -> Outcome:
    c.wait(dist.barrier(group=c.group, async_op=c.async_op))
    return []


def _send_recv(nonblocking: bool) -> Callable[[Case], Outcome]:
    """A ring: every rank sends its row to the next rank and receives the previous rank's."""

    def check(c: Case) -> Outcome:
        if c.async_op or c.n < 2:
            return None  # point to point has no async_op flag (isend is its async form) and needs a peer
        nxt, prv = c.ranks[(c.g + 1) % c.n], c.ranks[(c.g - 1) % c.n]
        mine, got = c.tensor(_row(c.g)), c.empty()
        send, recv = (dist.isend, dist.irecv) if nonblocking else (dist.send, dist.recv)
        # A token ring: rank 0 sends first, every other rank receives first, so even two ranks that share one
        # NCCL stream never both wait in a send.
        steps = [(send, mine, nxt), (recv, got, prv)]
        if c.g != 0:
            steps.reverse()
        works = [fn(t, peer, group=c.group) for fn, t, peer in steps]
        for work in works if nonblocking else []:  # send/recv have finished (and return the peer's rank)
            work.wait()
        return [(got, _row((c.g - 1) % c.n))]

    return check


CHECKS: dict[str, Callable[[Case], Outcome]] = {
    "broadcast": _broadcast,
    **{f"all_reduce_{kind}": _all_reduce(kind) for kind in REDUCTIONS},
    "reduce": _reduce,
    "all_gather": _all_gather(flat=False),
    "all_gather_into_tensor": _all_gather(flat=True),
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter(flat=False),
    "reduce_scatter_tensor": _reduce_scatter(flat=True),
    "all_to_all": _all_to_all(flat=False),
    "all_to_all_single": _all_to_all(flat=True),
    "barrier": _barrier,
    "send_recv": _send_recv(nonblocking=False),
    "isend_irecv": _send_recv(nonblocking=True),
}


@dataclass(frozen=True)
class Tamper:
    """The test hook: which checks get a corrupted expected value, and which raise (on which ranks)."""

    wrong: frozenset[str] = frozenset()
    raises: tuple[tuple[str, int | None], ...] = ()

    @classmethod
    def from_env(cls) -> Tamper:
        wrong, raises = set(), []
        for spec in filter(None, os.environ.get(TAMPER_ENV, "").split(",")):
            op, _, mode = spec.partition(":")
            if mode.startswith("raise"):
                rank = mode.partition("@")[2]
                raises.append((op, int(rank) if rank else None))
            else:
                wrong.add(op)
        return cls(frozenset(wrong), tuple(raises))

    def raises_on(self, op: str, rank: int) -> bool:
        return any(o == op and r in (None, rank) for o, r in self.raises)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_op(op: str, case: Case, tamper: Tamper) -> tuple[str, str]:
    """Run one check on this rank: (ok | WRONG | raised | n/a, detail)."""
    try:
        if tamper.raises_on(op, dist.get_rank()):
            raise NotImplementedError(f"{op} disabled by {TAMPER_ENV}")
        pairs = CHECKS[op](case)
        _sync(case.device)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return "raised", f"{type(e).__name__}: {_first_line(e)}"
    if pairs is None:
        return "n/a", ""
    for got, values in pairs:
        got = got.detach().cpu().flatten()
        want = torch.tensor(values, dtype=got.dtype)
        if op in tamper.wrong:
            want[0] += 1
        if not torch.equal(got, want):
            i = int((got != want).nonzero()[0])
            return (
                "WRONG",
                f"rank {dist.get_rank()}: element {i} is {got[i].item()}, expected {want[i].item()}",
            )
    return "ok", ""


def merge(outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """One verdict from every rank's (status, detail); 'error' when ranks failed differently."""
    raised = [(r, d) for r, (s, d) in enumerate(outcomes) if s == "raised"]
    took_part = [s for s, _ in outcomes if s != "n/a"]
    if raised:
        if len(raised) == len(took_part) and len({d for _, d in raised}) == 1:
            return "unsupported", raised[0][1]
        return "error", "; ".join(
            f"rank {r} {d}" for r, d in raised
        ) + "; the other ranks did not fail the same way"
    wrong = [d for s, d in outcomes if s == "WRONG"]
    if wrong:
        return "WRONG", "; ".join(wrong)
    return ("ok", "") if took_part else ("n/a", "")


@dataclass
class CheckRow:
    """One operation checked one way."""

    op: str
    device: str
    group: str
    status: str
    detail: str


def _cases(ctx: DistContext, device: torch.device, sub: Any) -> list[tuple[str, Case | None]]:
    """(column, case) for the default group, async calls and the even-rank group `sub` (None: not a member)."""
    world = tuple(range(ctx.world_size))
    even = world[::2]
    return [
        ("world", Case(None, world, device, async_op=False)),
        ("world async", Case(None, world, device, async_op=True)),
        (
            "ranks " + ",".join(map(str, even)),
            Case(sub, even, device, async_op=False) if ctx.rank in even else None,
        ),
    ]


def run_check(ctx: DistContext, ops: list[str], control: Any) -> tuple[list[CheckRow], bool]:
    """Every op in `ops`, every way, on every device; returns the rows and whether the check ran to the end.

    The ranks agree on each verdict over `control`, a group of its own, so an op stuck on another group cannot
    hold the verdict up (the stuck op times out after dist.timeout_s instead).
    """
    tamper = Tamper.from_env()
    devices = [torch.device("cpu")] + ([ctx.device] if ctx.device.type == "cuda" else [])
    sub = dist.new_group(list(range(0, ctx.world_size, 2)))  # every rank must call new_group, members or not
    rows: list[CheckRow] = []
    for device in devices:
        for column, case in _cases(ctx, device, sub):
            for op in ops:
                mine = try_op(op, case, tamper) if case is not None else ("n/a", "")
                status, detail = merge(all_gather_object(mine, group=control))
                rows.append(CheckRow(op, device.type, column, status, detail))
                if status == "error":
                    return rows, False
    return rows, True


# ---------------------------------------------------------------------------------------- the benchmark

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
    _sync(device)
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
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
    ctx: DistContext, opts: CommOptions
) -> tuple[list[BenchRow], dict[str, str], dict[str, float]]:
    """The sweep: rows, ops that could not run (with why), and the memory-copy bandwidth of the largest size."""
    n, dtype, device = ctx.world_size, DTYPES[opts.dtype], ctx.device
    elem = torch.tensor([], dtype=dtype).element_size()
    rows: list[BenchRow] = []
    skipped: dict[str, str] = {}
    for op in opts.bench_ops:
        if op == "send_recv" and n < 2:
            skipped[op] = "needs 2 ranks"
            continue
        for size in opts.sizes:
            count = size // elem // n * n if op in SPLIT_OPS else size // elem
            if count == 0:
                continue
            try:
                t = time_per_call(_bench_call(op, count, n, dtype, device), opts.iters, opts.warmup, device)
            except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
                skipped[op] = f"{type(e).__name__}: {_first_line(e)}"
                break
            algbw = count * elem / t / 1e9
            rows.append(BenchRow(op, count * elem, count, t * 1e6, algbw, algbw * BUS_FACTOR[op](n)))
    count = max(1, max(opts.sizes) // elem)
    src = torch.ones(count, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), opts.iters, opts.warmup, device)
    memcpy = {"bytes": count * elem, "time_us": t * 1e6, "GBps": count * elem / t / 1e9}
    return rows, skipped, memcpy


# -------------------------------------------------------------------------------------------- the flags


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise ValueError(text)
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """`4K-256M` (doubling from 4 KiB to 256 MiB) or `1K,1M` -> message sizes in bytes."""
    try:
        if "-" in text:
            lo, hi = (_size(part) for part in text.split("-", 1))
            if lo > hi:
                raise ValueError(text)
            return [lo << k for k in range((hi // lo).bit_length())]
        return sorted({_size(part) for part in text.split(",")})
    except ValueError:
        raise UserError(
            f"--sizes '{text}' is not a size range or list",
            "write e.g. 4K-256M (doubling) or 1K,64K,1M; K, M, G are 1024, 1024^2, 1024^3 bytes",
        ) from None


def family(op: str) -> str:
    """The benchmark an op belongs to: all_reduce_sum -> all_reduce, isend_irecv -> send_recv."""
    if op == "isend_irecv":
        return "send_recv"
    return next((b for b in BUS_FACTOR if op == b or op.startswith(b + "_")), op)


OP_NAMES = (*CHECKS, "all_reduce")


def parse_ops(text: str) -> list[str]:
    """`all_reduce,broadcast` -> the op names; a family name (all_reduce) selects all of its checks."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names or [text]:
        if name not in OP_NAMES:
            close = difflib.get_close_matches(name, OP_NAMES, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "choose from " + ", ".join(OP_NAMES)
            raise UserError(f"--ops: unknown operation '{name}'", hint)
    return names


def _int_flag(flag: str, minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise UserError(
                f"{flag} must be an integer >= {minimum}, got '{text}'", f"use e.g. {flag} {minimum + 4}"
            )
        return value

    return parse


def _json_path(text: str) -> str:
    parent = Path(text).resolve().parent
    if not parent.is_dir() or Path(text).is_dir():
        raise UserError(
            f"--json {text}: cannot write a file there", "give a file path in an existing directory"
        )
    return text


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`ddpkit comm`'s own flags; bad values are user errors found before any worker starts."""
    g = parser.add_argument_group("comm flags")
    ops_help = "operations, default all (all_reduce = all its reduce ops; all_gather = both forms, ...): "
    g.add_argument("--ops", type=parse_ops, metavar="OP,...", help=ops_help + ", ".join(CHECKS))
    sizes_help = (
        f"benchmark message sizes: LO-HI doubles, S,S,... lists; K/M/G suffixes (default {DEFAULT_SIZES})"
    )
    g.add_argument("--sizes", type=parse_sizes, metavar="LO-HI|S,...", help=sizes_help)
    g.add_argument(
        "--iters", type=_int_flag("--iters", 1), default=20, metavar="N", help="timed calls (default 20)"
    )
    g.add_argument(
        "--warmup", type=_int_flag("--warmup", 0), default=5, metavar="N", help="untimed calls (default 5)"
    )
    g.add_argument("--json", type=_json_path, metavar="FILE", help="also write the results as JSON (rank 0)")
    g.add_argument("--dtype", choices=list(DTYPES), default="float32", help="benchmark element type")
    only = g.add_mutually_exclusive_group()
    only.add_argument("--check-only", action="store_true", help="check correctness, skip the benchmark")
    only.add_argument("--bench-only", action="store_true", help="benchmark, skip the correctness check")


@dataclass(frozen=True)
class CommOptions:
    """What to check and measure, resolved from the flags."""

    check_ops: list[str]
    bench_ops: list[str]
    sizes: list[int]
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    json: str | None = None
    check: bool = True
    bench: bool = True


def options(args: argparse.Namespace) -> CommOptions:
    """The flags (already validated by their parsers) with the defaults filled in."""
    chosen = set(args.ops or OP_NAMES)
    return CommOptions(
        check_ops=[op for op in CHECKS if op in chosen or family(op) in chosen],
        bench_ops=[op for op in BUS_FACTOR if op in {family(name) for name in chosen}],
        sizes=args.sizes or parse_sizes(DEFAULT_SIZES),
        iters=args.iters,
        warmup=args.warmup,
        dtype=args.dtype,
        json=args.json,
        check=not args.bench_only,
        bench=not args.check_only,
    )


# ------------------------------------------------------------------------------------------- the report


def check_table(rows: list[CheckRow]) -> str:
    """Ops down, (device, way) across; then one line per verdict that is not ok."""
    columns = list(dict.fromkeys((r.device, r.group) for r in rows))
    cell = {(r.op, r.device, r.group): r.status for r in rows}
    ops = list(dict.fromkeys(r.op for r in rows))
    width = max(11, *(len(g) for _, g in columns))
    lines = [f"{'operation':24s}" + "".join(f"{f'{d} {g}':>{width + 5}s}" for d, g in columns)]
    for op in ops:
        lines.append(f"{op:24s}" + "".join(f"{cell.get((op, d, g), '-'):>{width + 5}s}" for d, g in columns))
    lines += [f"  {r.status}: {r.op} [{r.device}, {r.group}] {r.detail}" for r in rows if r.detail]
    return "\n".join(lines)


def bench_table(rows: list[BenchRow], skipped: dict[str, str]) -> str:
    """nccl-tests-like columns: size, count, time per call, algorithm and bus bandwidth."""
    lines = [
        f"{'operation':16s}{'size(B)':>12s}{'count':>12s}{'time(us)':>12s}{'algbw(GB/s)':>13s}{'busbw(GB/s)':>13s}"
    ]
    for r in rows:
        lines.append(
            f"{r.op:16s}{r.bytes:12d}{r.count:12d}{r.time_us:12.1f}{r.algbw_GBps:13.3f}{r.busbw_GBps:13.3f}"
        )
    lines += [f"  {op}: not run ({why})" for op, why in skipped.items()]
    return "\n".join(lines)


def latency_us(rows: list[BenchRow]) -> dict[str, float]:
    """Time per call at each op's smallest size."""
    ops = dict.fromkeys(r.op for r in rows)
    return {op: min((r for r in rows if r.op == op), key=lambda r: r.bytes).time_us for op in ops}


def _largest(rows: list[BenchRow], op: str) -> BenchRow | None:
    return max((r for r in rows if r.op == op), key=lambda r: r.bytes, default=None)


def summary(
    ctx: DistContext, rows: list[CheckRow], bench: list[BenchRow], memcpy: dict[str, float] | None
) -> str:
    """The one-line verdict."""
    where = f"{ctx.backend}, {ctx.world_size} rank(s), {ctx.device}"
    parts = []
    if rows:
        count = {s: sum(r.status == s for r in rows) for s in ("ok", "WRONG", "unsupported", "error", "n/a")}
        bad = sorted({r.op for r in rows if r.status in ("WRONG", "error")})
        parts.append(
            f"check {'FAILED' if bad else 'passed'}: {count['ok']} ok, {count['WRONG']} WRONG, "
            f"{count['unsupported']} unsupported, {count['error']} error, {count['n/a']} n/a"
            + (f" ({', '.join(bad)})" if bad else "")
        )
    big = _largest(bench, "all_reduce")
    if big and memcpy:
        parts.append(
            f"all_reduce {big.bytes} B busbw {big.busbw_GBps:.3f} GB/s = "
            f"{big.busbw_GBps / memcpy['GBps']:.3f} x memory copy ({memcpy['GBps']:.3f} GB/s)"
        )
    return f"ddpkit comm ({where}): " + "; ".join(parts)


# ------------------------------------------------------------------------------------------ the command


def _ensure_group(ctx: DistContext) -> None:
    """A single process still checks its backend: a one-rank group on an in-memory store."""
    if not dist.is_initialized():
        dist.init_process_group(ctx.backend, store=dist.HashStore(), rank=0, world_size=1)


def comm_command(cfg: Any, args: argparse.Namespace, ctx: DistContext) -> int:
    """Check every collective, then benchmark them; rank 0 reports and exits 1 if any check is WRONG or failed."""
    opts = options(args)
    _ensure_group(ctx)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2 * cfg.dist.timeout_s + 60))
    checks: list[CheckRow] = []
    complete = True
    if opts.check:
        checks, complete = run_check(ctx, opts.check_ops, control)
    bench: list[BenchRow] = []
    skipped: dict[str, str] = {}
    memcpy = None
    if opts.bench and opts.bench_ops and complete:
        bench, skipped, memcpy = run_benchmark(ctx, opts)
    if ctx.rank == 0:
        _report(ctx, opts, checks, complete, bench, skipped, memcpy)
    dist.barrier(group=control)  # no rank leaves (so the launcher stops the rest) before the report is out
    failed = any(r.status in ("WRONG", "error") for r in checks)
    return (
        1 if failed and ctx.rank == 0 else 0
    )  # every rank knows the verdict; the reporting rank exits with it


def _report(
    ctx: DistContext,
    opts: CommOptions,
    checks: list[CheckRow],
    complete: bool,
    bench: list[BenchRow],
    skipped: dict[str, str],
    memcpy: dict[str, float] | None,
) -> None:
    """Rank 0: the check table, the benchmark table, the summary line, and the JSON file."""
    head = f"ddpkit comm: {ctx.backend}, {ctx.world_size} rank(s), device {ctx.device}"
    if checks:
        print(f"{head}: correctness check", flush=True)
        print(check_table(checks), flush=True)
        if not complete:
            print(
                "check stopped: ranks failed differently, so the group can no longer be trusted", flush=True
            )
    if bench or skipped:
        print(
            f"\n{head}: benchmark, {opts.dtype}, {opts.iters} timed calls after {opts.warmup} warm-up",
            flush=True,
        )
        print(bench_table(bench, skipped), flush=True)
        lat = ", ".join(f"{op} {us:.1f} us" for op, us in latency_us(bench).items())
        print(f"latency (smallest size): {lat}", flush=True)
        print(
            f"memory copy ({memcpy['bytes']} B, tensor copy_): {memcpy['GBps']:.3f} GB/s per rank", flush=True
        )
    print(summary(ctx, checks, bench, memcpy), flush=True)
    if opts.json:
        big = _largest(bench, "all_reduce")
        report = {
            "backend": ctx.backend,
            "world_size": ctx.world_size,
            "device": str(ctx.device),
            "dtype": opts.dtype,
            "iters": opts.iters,
            "warmup": opts.warmup,
            "check_complete": complete,
            "check": [asdict(r) for r in checks],
            "bench": [asdict(r) for r in bench],
            "bench_not_run": skipped,
            "latency_us": latency_us(bench),
            "memcpy": memcpy,
            "all_reduce_busbw_over_memcpy": big.busbw_GBps / memcpy["GBps"] if big and memcpy else None,
        }
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
