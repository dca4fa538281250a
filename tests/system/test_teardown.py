"""An interrupted session leaves nothing behind: SIGINT/SIGTERM run the finalisers, and what a SIGKILLed
session left (daemons, namespaces, links) is swept by the next one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cli_env

from .helpers import tail
from .infra import Session, sweep

pytestmark = pytest.mark.system
HOLD = "DDPKIT_TEST_HOLD"  # set by the tests below: the holder test then writes READY and waits


@pytest.mark.skipif(HOLD not in os.environ, reason="runs only inside test_an_interrupted_session_*")
def test_hold_the_cluster_until_interrupted(slurm, netns, system_session):
    ready = {"dir": str(system_session.dir), "netns": list(netns.names), "peers": list(netns.peers)}
    Path(os.environ[HOLD]).write_text(json.dumps(ready))
    while True:  # until the test that started this session interrupts it (or pytest-timeout)
        time.sleep(1)


def _start_holder(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / "ready.json"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"{__file__}::test_hold_the_cluster_until_interrupted",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=cli_env({HOLD: str(ready)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a suite started in the background (`make test &`, nohup) inherits SIGINT ignored, and Python then
        # never turns it into KeyboardInterrupt: give the holder the terminal's Ctrl-C, as a user's session has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 180
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the holder session did not come up:\n{tail(proc.communicate()[0])}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())


def _left_behind(held: dict) -> list[str]:
    state = Path(held["dir"])
    procs = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(state).encode() in _read(p / "cmdline")
    ]
    namespaces = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return (
        [f"process {p}" for p in procs]
        + [f"netns {n}" for n in held["netns"] if n in namespaces]
        + [f"link {p}" for p in held["peers"] if f" {p}@" in links or f" {p}:" in links]
        + ([f"state {state}"] if state.exists() else [])
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_an_interrupted_session_stops_its_daemons_and_removes_its_namespaces(tmp_path, sig):
    proc, held = _start_holder(tmp_path)
    assert _left_behind(held), "the holder made nothing"
    proc.send_signal(sig)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out
    assert _left_behind(held) == [], tail(out)


@pytest.mark.slow
def test_a_killed_session_is_swept_by_the_next(tmp_path):
    proc, held = _start_holder(tmp_path)
    proc.kill()  # SIGKILL: no finaliser runs
    proc.wait()
    assert _left_behind(held), "SIGKILL should have left the daemons behind"
    removed = sweep()
    assert _left_behind(held) == [], removed
    assert any(r.startswith("netns ") for r in removed), removed


def test_the_sweep_spares_live_sessions(system_session):
    here = Session.create()
    sweep()  # both sessions belong to this live pytest process
    assert here.dir.is_dir() and system_session.dir.is_dir()
    here.cleanup()
