"""Check every collective against values computed in closed form (what `ddpkit comm` runs first).

Each operation runs on the default group, with `async_op=True`, and on a `new_group` of the even ranks, on CPU
tensors (and GPU tensors when the device is cuda). Every rank compares its result with the closed-form value;
the ranks then agree, over a separate gloo control group, on ok / WRONG / unsupported (every rank raised the
same error: discovered by trying) / error (ranks failed differently: the check stops there).

Test hook: DDPKIT_COMM_TAMPER=OP[,OP...] corrupts one expected value of OP (the check must say WRONG);
`OP:raise` makes OP raise on every rank (unsupported) and `OP:raise@R` only on rank R (error).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit import channels
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import first_line

TAMPER_ENV = channels.COMM_TAMPER
CHUNK = 5  # elements each rank contributes to a checked operation
FULL = (1 << 62) - 1  # 62 one-bits: the bitwise reductions' universe
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def try_op(op: str, case: Case, tamper: Tamper) -> tuple[str, str]:
    """Run one check on this rank: (ok | WRONG | raised | n/a, detail)."""
    try:
        if tamper.raises_on(op, dist.get_rank()):
            raise NotImplementedError(f"{op} disabled by {TAMPER_ENV}")
        pairs = CHECKS[op](case)
        sync(case.device)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return "raised", f"{type(e).__name__}: {first_line(e)}"
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
