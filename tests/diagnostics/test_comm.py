"""`ddpkit comm`: the collectives check catches wrong results, the benchmark reports nccl-tests' bandwidths."""

from __future__ import annotations

import argparse
import functools
import json
import math
import operator

import pytest

from conftest import assert_user_error, run_cli
from ddpkit.commands import comm as commcheck
from ddpkit.diagnostics import collective_bench, collective_check
from ddpkit.errors import UserError

SMALL = ("--sizes", "4K-64K", "--iters", "3", "--warmup", "1")
PY_OPS = {
    "sum": operator.add,
    "product": operator.mul,
    "min": min,
    "max": max,
    "band": operator.and_,
    "bor": operator.or_,
    "bxor": operator.xor,
}


def _run_comm(tmp_path, *args, env=None):
    """`ddpkit comm ARGS --json FILE` -> (process, the JSON report or None)."""
    out = tmp_path / "comm.json"
    proc = run_cli("comm", *args, "--json", str(out), env=env)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _statuses(report, **where):
    return {
        (r["op"], r["group"]): r["status"]
        for r in report["check"]
        if all(r[k] == v for k, v in where.items())
    }


# ------------------------------------------------------------------------------------------- pure logic


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("kind", list(collective_check.REDUCTIONS))
def test_closed_forms_equal_the_reduction_done_rank_by_rank(kind, n):
    _, _, element, closed_form = collective_check.REDUCTIONS[kind]
    for j in range(collective_check.CHUNK):
        assert functools.reduce(PY_OPS[kind], [element(r, j) for r in range(n)]) == closed_form(n, j), (
            kind,
            n,
            j,
        )


def test_sizes_double_over_a_range_or_come_as_a_list():
    assert commcheck.parse_sizes("4K-32K") == [4096, 8192, 16384, 32768]
    assert commcheck.parse_sizes("4K-256M")[-1] == 256 << 20
    assert len(commcheck.parse_sizes("4K-256M")) == 17
    assert commcheck.parse_sizes("1M,1K,64") == [64, 1024, 1 << 20]
    assert commcheck.parse_sizes("2KiB") == [2048]
    for bad in ("4Q", "0", "1M-4K", "", "4K-"):
        with pytest.raises(UserError):
            commcheck.parse_sizes(bad)


def test_ops_select_checks_and_benchmarks_by_family():
    def opts(ops):
        ns = argparse.Namespace(
            ops=commcheck.parse_ops(ops), sizes=None, iters=1, warmup=0, dtype="float32", json=None
        )
        ns.check_only = ns.bench_only = False
        return commcheck.options(ns)

    assert opts("all_reduce_sum").check_ops == ["all_reduce_sum"]
    assert opts("all_reduce_sum").bench_ops == ["all_reduce"]
    assert len(opts("all_reduce").check_ops) == 7
    assert opts("all_gather,barrier").check_ops == ["all_gather", "all_gather_into_tensor", "barrier"]
    assert opts("isend_irecv").bench_ops == ["send_recv"]
    assert opts("gather").bench_ops == []
    with pytest.raises(UserError, match="did you mean 'all_gather'"):
        commcheck.parse_ops("all_gathr")


def test_verdicts_agree_across_ranks():
    assert collective_check.merge([("ok", ""), ("n/a", "")]) == ("ok", "")
    assert collective_check.merge([("n/a", ""), ("n/a", "")]) == ("n/a", "")
    assert collective_check.merge([("ok", ""), ("WRONG", "rank 1: x")]) == ("WRONG", "rank 1: x")
    assert collective_check.merge([("raised", "E: no"), ("raised", "E: no")]) == ("unsupported", "E: no")
    assert collective_check.merge([("raised", "E: no"), ("ok", "")])[0] == "error"
    assert collective_check.merge([("raised", "E: no"), ("raised", "Timeout")])[0] == "error"


def test_bus_bandwidth_factors_are_nccl_tests():
    factor = {op: f(4) for op, f in collective_bench.BUS_FACTOR.items()}
    assert factor == {
        "all_reduce": 1.5,
        "all_gather": 0.75,
        "reduce_scatter": 0.75,
        "broadcast": 1.0,
        "all_to_all": 0.75,
        "send_recv": 1.0,
    }


# ------------------------------------------------------------------------------------------ the command


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--ops", "all_reduce_summ"), "unknown operation 'all_reduce_summ'"),
        (("--sizes", "4Q"), "--sizes '4Q'"),
        (("--sizes", "1M-4K"), "--sizes '1M-4K'"),
        (("--iters", "0"), "--iters must be an integer >= 1"),
        (("--dtype", "float8"), "invalid choice"),
        (("--check-only", "--bench-only"), "not allowed with"),
    ],
)
def test_bad_flags_are_one_line_user_errors_before_workers_start(args, fragment):
    assert_user_error(run_cli("comm", *args, "--nproc-per-node", "2"), fragment)


def test_single_process_checks_its_backend_and_benchmarks(tmp_path):
    proc, report = _run_comm(tmp_path, "--sizes", "4K,8K", "--iters", "2", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check passed" in proc.stdout.splitlines()[-1]
    world = _statuses(report, group="world")
    assert world[("send_recv", "world")] == "n/a"  # no peer to talk to
    assert world[("all_reduce_sum", "world")] == "ok"
    assert {r["op"] for r in report["bench"]} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
    }
    assert "send_recv" in report["bench_not_run"]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_checks_out_on_gloo_and_is_benchmarked(tmp_path, n):
    proc, report = _run_comm(tmp_path, "--nproc-per-node", str(n), *SMALL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith(f"ddpkit comm (gloo, {n} rank(s), cpu): check passed:"), lines[-1]
    assert "busbw" in proc.stdout and "memory copy" in lines[-1]

    assert report["world_size"] == n and report["check_complete"]
    sub = "ranks " + ",".join(str(r) for r in range(0, n, 2))
    assert {(r["group"]) for r in report["check"]} == {"world", "world async", sub}
    assert {r["op"] for r in report["check"]} == set(collective_check.CHECKS)
    for r in report["check"]:
        p2p_na = r["op"] in ("send_recv", "isend_irecv") and (
            r["group"] == "world async" or n == 2 and r["group"] == sub
        )
        assert r["status"] == ("n/a" if p2p_na else "ok") or r["status"] == "unsupported", r
    assert sum(r["status"] == "ok" for r in report["check"]) >= 50

    sizes = [4096 << k for k in range(5)]
    elem = 4
    for op, factor in collective_bench.BUS_FACTOR.items():
        rows = [r for r in report["bench"] if r["op"] == op]
        assert len(rows) == len(sizes), op
        for r, size in zip(rows, sizes, strict=True):
            split = op in collective_bench.SPLIT_OPS
            assert r["bytes"] == (size // elem // n * n if split else size // elem) * elem
            assert r["time_us"] > 0
            assert math.isclose(r["algbw_GBps"], r["bytes"] / r["time_us"] / 1e3, rel_tol=1e-9)
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * factor(n), rel_tol=1e-9)
        assert report["latency_us"][op] == rows[0]["time_us"]
    assert report["memcpy"]["bytes"] == sizes[-1] and report["memcpy"]["GBps"] > 0
    largest = [r for r in report["bench"] if r["op"] == "all_reduce"][-1]
    assert math.isclose(
        report["all_reduce_busbw_over_memcpy"], largest["busbw_GBps"] / report["memcpy"]["GBps"]
    )


@pytest.mark.slow
def test_a_tampered_expected_value_is_caught_and_an_unsupported_op_reported(tmp_path):
    env = {collective_check.TAMPER_ENV: "all_reduce_sum,scatter:raise"}
    proc, report = _run_comm(tmp_path, "--nproc-per-node", "2", "--check-only", env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("ddpkit comm (")]
    assert len(summary) == 1 and "check FAILED" in summary[0] and "(all_reduce_sum)" in summary[0], summary
    for (op, group), status in _statuses(report).items():
        want = {"all_reduce_sum": "WRONG", "scatter": "unsupported"}.get(op, "ok")
        assert status == want or status == "n/a" and op in ("send_recv", "isend_irecv"), (op, group, status)
    wrong = [r for r in report["check"] if r["status"] == "WRONG"]
    assert len(wrong) == 3 and all("expected 4.0" in r["detail"] for r in wrong if r["group"] == "world")
    assert report["bench"] == []


@pytest.mark.slow
def test_an_op_failing_on_one_rank_only_stops_the_check_instead_of_hanging(tmp_path):
    env = {collective_check.TAMPER_ENV: "all_reduce_min:raise@1"}
    proc, report = _run_comm(tmp_path, "--nproc-per-node", "2", "--check-only", "dist.timeout_s=5", env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check stopped" in proc.stdout
    assert not report["check_complete"]
    last = report["check"][-1]
    assert (last["op"], last["status"]) == ("all_reduce_min", "error")
    assert "rank 1 NotImplementedError" in last["detail"]
