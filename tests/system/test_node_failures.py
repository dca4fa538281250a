"""Failures across nodes, for real: two namespaces ("hosts") on a bridge, a c10d rendezvous at node 0's address,
2 nodes x 1 worker. A node dies (its launcher and worker SIGKILLed) with and without a replacement, a network
partition longer than dist.timeout_s (node 1's cable pulled), and a blip shorter than a second.

Each test prints how long the failure took to be noticed and reported (pytest -s shows it); the benchmark
benchmarks/fault_recovery.py --nodes measures the same over several trials.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli

from .helpers import TRAIN, Timed, final_weights, kill_tree, metrics, ok
from .helpers import c10d as c10d_flags

pytestmark = [pytest.mark.system, pytest.mark.slow]

TIMEOUT_S = 8  # dist.timeout_s of these runs
MARGIN_S = 30  # what a failure may take beyond it to end a node's launcher (measured: 3-25 s)
FAULT_TRAIN = [
    *[t for t in TRAIN if not t.startswith("train.epochs=")],
    "train.epochs=12",
    "train.log_every=1",
    "checkpoint.every_steps=4",
    f"dist.timeout_s={TIMEOUT_S}",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the same run, unbroken, as 2 processes on this host."""
    out = tmp_path_factory.mktemp("reference") / "run"
    ok(run_cli("train", *FAULT_TRAIN, f"out_dir={out}", "--nproc-per-node", "2"))
    return final_weights(out)


def c10d(netns, port: int, restarts: int, rdzv_timeout: int = 20) -> list[str]:
    extra = ["--rdzv-timeout", str(rdzv_timeout), "--max-restarts", str(restarts)]
    return c10d_flags(netns.addrs[0], port, f"faults-{port}", 1, *extra)


def start(netns, node: int, out: Path, launch: list[str], t0: float) -> Timed:
    return Timed(netns.ddpkit(node, "train", *FAULT_TRAIN, f"out_dir={out}", *launch), t0)


def wait_for_progress(out: Path, nodes: list[Timed], timeout: float = 180) -> None:
    """Until a checkpoint exists and the second epoch runs (so a failure lands mid-training)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = out / "log.txt"
        if (out / "checkpoints" / "last.pt").exists() and log.exists() and "[2/12]" in log.read_text():
            return
        dead = [n for n in nodes if n.poll_ended()]
        assert not dead, "\n---\n".join(n.text()[-3000:] for n in dead)
        time.sleep(0.05)
    raise AssertionError("the run made no progress:\n" + "\n---\n".join(n.text()[-3000:] for n in nodes))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def gave_up_lines(log: str, rank: int) -> list[str]:
    """log.txt's lines of `rank` giving up on a collective (a rank that only waited for a lost one writes its
    line there, not to the terminal)."""
    return [ln for ln in log.splitlines() if f"rank {rank} gave up on a collective" in ln]


def report(what: str, **times: float | None) -> None:
    print(
        f"\n[{what}] " + ", ".join(f"{k}={v:.1f}s" if v is not None else f"{k}=-" for k, v in times.items())
    )


def test_a_node_dies_and_its_replacement_finishes_the_job_like_an_unbroken_run(netns, tmp_path, reference):
    out, t0 = tmp_path / "run", time.monotonic()
    launch = c10d(netns, 29501, restarts=2, rdzv_timeout=60)
    a, b = start(netns, 0, out, launch, t0), start(netns, 1, out, launch, t0)
    wait_for_progress(out, [a, b])
    t_kill = time.monotonic() - t0
    kill_tree(b.proc.pid)  # node 1 dies: its launcher and its worker, at once
    b.wait(30)
    time.sleep(1)
    b2 = start(netns, 1, out, launch, t0)  # the node comes back: the same command
    assert (a.wait(300), b2.wait(60)) == (0, 0), f"{a.text()[-3000:]}\n---\n{b2.text()[-3000:]}"
    # rank 0 only gave up waiting for rank 1: its line is in log.txt, not on the terminal (the launcher restarts
    # the workers, so no launcher line either); the rerun says it resumed
    log = (out / "log.txt").read_text()
    noticed, resumed = gave_up_lines(log, 0), a.first("resumed from")
    assert noticed and resumed, f"{log[-3000:]}\n---\n{a.text()[-3000:]}"
    assert not a.first("ddpkit: error: "), a.text()[-3000:]
    assert log.index(noticed[0]) < log.index("resumed from"), log[-3000:]  # the loss, then the resumption
    report("node dies, replaced", resumed=resumed[0] - t_kill)
    assert [r["epoch"] for r in metrics(out)] == list(range(1, 13))
    assert same_weights(final_weights(out), reference) == []


def test_a_node_dies_for_good_and_the_other_ends_within_the_rendezvous_timeout_naming_it(netns, tmp_path):
    out, t0 = tmp_path / "run", time.monotonic()
    launch = c10d(netns, 29511, restarts=2, rdzv_timeout=20)
    a, b = start(netns, 0, out, launch, t0), start(netns, 1, out, launch, t0)
    wait_for_progress(out, [a, b])
    t_kill = time.monotonic() - t0
    kill_tree(b.proc.pid)
    b.wait(30)
    assert a.wait(120) == 1, a.text()[-3000:]  # a failure, not a user error
    last = a.first("joined the rendezvous")
    assert last and last[1].startswith("ddpkit: error: "), a.text()[-3000:]
    assert f"lost: {netns.hosts[1]}" in last[1] and "--rdzv-timeout 20" in last[1], a.text()[-3000:]
    report("node dies for good", error=last[0] - t_kill, exit=a.ended - t_kill)
    assert a.ended - t_kill < 20 + MARGIN_S


def test_a_partition_longer_than_the_timeout_ends_every_node_then_the_rerun_resumes(
    netns, tmp_path, reference
):
    out, t0 = tmp_path / "run", time.monotonic()
    launch = c10d(netns, 29521, restarts=0)
    a, b = start(netns, 0, out, launch, t0), start(netns, 1, out, launch, t0)
    wait_for_progress(out, [a, b])
    t_cut = time.monotonic() - t0
    netns.link(1, up=False)  # node 1's cable is pulled
    try:
        deadline = time.monotonic() + TIMEOUT_S + MARGIN_S + 30
        while not (a.poll_ended() and b.poll_ended()) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = (a.wait(1), b.wait(1))
    finally:
        netns.link(1, up=True)
    text = f"{a.text()[-3000:]}\n---\n{b.text()[-3000:]}"
    assert 0 not in codes, (codes, text)
    assert "ddpkit: error: ddpkit: error:" not in text, text  # one prefix per line
    # Each node's one line names what it lost: node 0 the rank that stopped responding (the line its rank 0
    # left), node 1 the rendezvous store (its launcher's watch; its rank 1's line is in log.txt).
    seen_a, seen_b = a.first("ddpkit: error: "), b.first("ddpkit: error: ")
    assert seen_a and seen_a[1].startswith("ddpkit: error: rank 0 gave up on a collective"), text
    assert f"rank 1 on {netns.hosts[1]}" in seen_a[1], text  # node 0 names the rank it lost
    assert seen_b and seen_b[1].startswith(
        f"ddpkit: error: this node ({netns.hosts[1]}) lost the rendezvous"
    ), text
    assert f"store at {netns.addrs[0]}:" in seen_b[1], text  # node 1 names the node it lost
    log = (out / "log.txt").read_text()
    waited = gave_up_lines(log, 1)  # and its rank that gave up, which store did not answer
    assert waited and f"store at {netns.hosts[0]}:" in waited[0], log[-3000:]
    report(
        "partition",
        node0_error=seen_a[0] - t_cut,
        node0_exit=a.ended - t_cut,
        node1_error=seen_b[0] - t_cut,
        node1_exit=b.ended - t_cut,
    )
    for node in (a, b):
        assert node.ended - t_cut < TIMEOUT_S + MARGIN_S, text
    for ckpt in (out / "checkpoints").glob("*.pt"):  # nothing written is torn
        torch.load(ckpt, map_location="cpu", weights_only=True)
    # The cable is back: the same command on both nodes resumes and finishes.
    rerun = [start(netns, n, out, c10d(netns, 29522, restarts=0), t0) for n in (0, 1)]
    assert [n.wait(300) for n in rerun] == [0, 0], "\n---\n".join(n.text()[-3000:] for n in rerun)
    assert rerun[0].first("resumed from"), rerun[0].text()[-3000:]
    assert same_weights(final_weights(out), reference) == []


def test_a_blip_shorter_than_a_second_changes_nothing(netns, tmp_path, reference):
    out, t0 = tmp_path / "run", time.monotonic()
    launch = c10d(netns, 29531, restarts=0)
    a, b = start(netns, 0, out, launch, t0), start(netns, 1, out, launch, t0)
    wait_for_progress(out, [a, b])
    netns.link(1, up=False)
    time.sleep(0.7)
    netns.link(1, up=True)
    assert (a.wait(300), b.wait(300)) == (0, 0), f"{a.text()[-3000:]}\n---\n{b.text()[-3000:]}"
    assert not a.first("resumed from") and not a.first("ddpkit: error")
    assert same_weights(final_weights(out), reference) == []
