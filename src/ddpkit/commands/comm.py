"""`ddpkit comm`: check every collective against closed-form values, then measure bandwidth like nccl-tests.

The check lives in ddpkit.diagnostics.collective_check, the benchmark in ddpkit.diagnostics.collective_bench;
this module holds the flags, the tables and the report.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.diagnostics.collective_bench import BUS_FACTOR, DTYPES, BenchRow, run_benchmark
from ddpkit.diagnostics.collective_check import CHECKS, CheckRow, run_check
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError
from ddpkit.launcher.warm_start import EVERY_WORKER

DEFAULT_SIZES = "4K-256M"


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


def preload(cfg) -> list[str]:
    """The modules every worker imports (imported once by the launch's fork server: cli.py)."""
    return [*EVERY_WORKER, __name__, "ddpkit.diagnostics.collective_check"]


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
        bench, skipped, memcpy = run_benchmark(
            ctx, opts.bench_ops, opts.sizes, opts.dtype, opts.iters, opts.warmup
        )
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
