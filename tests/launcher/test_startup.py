"""Start-up (ddpkit.launcher.startup, ddpkit.launcher.warm_start): what is measured, and what a launch no longer pays.

Speed itself is measured in benchmarks/startup.py; here: the fields are right, the light imports stay light,
and a worker forked from the fork server is the worker a fresh interpreter would have been.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, cli_env, run_cli
from ddpkit.checkpoint import load_checkpoint
from ddpkit.launcher import startup
from ddpkit.train.metrics import read_metrics

PARTS = [f"startup_{stage}_s" for stage, _ in startup.STAGES]


def test_the_command_line_parses_and_loads_the_config_without_torch():
    code = (
        "import sys, ddpkit, ddpkit.cli; from ddpkit.commands import COMMANDS; "
        "ddpkit.cli.command_parser(COMMANDS['train']).parse_intermixed_args(['--nproc-per-node', '2']); "
        "ddpkit.cli._load(COMMANDS['train'], ddpkit.cli.parse(['train', 'train.epochs=2'])[1]); "
        "from ddpkit.commands.train import preload; from ddpkit.config import load_config; "
        "preload(load_config(None, [])); "
        "heavy = [m for m in ('torch', 'numpy', 'torchvision', 'matplotlib') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=cli_env())


def test_the_parts_add_up_to_the_total_and_start_at_the_launchers_start(monkeypatch):
    t0 = startup.this_process_start() - 5.0  # the launcher started 5 s before this process
    monkeypatch.setenv(startup.START_VAR, f"{t0:.6f} {os.getpid()}")
    monkeypatch.setattr(startup, "_marks", {})
    for name in ("imported", "rendezvous", "data", "model", "first_step"):
        startup.mark(name)
    fields = startup.measure()
    assert list(fields) == list(startup.FIELDS)
    assert fields["startup_s"] == pytest.approx(time.time() - t0, abs=0.5)
    assert sum(fields[p] for p in PARTS) == pytest.approx(fields["startup_s"], abs=0.01)
    assert fields["startup_launcher_s"] == pytest.approx(5.0, abs=0.02)
    line = startup.describe(fields)
    assert line.startswith(f"ddpkit: {fields['startup_s']:.2f} s from the command's start")
    assert "launcher 5." in line and "first step" in line


def test_a_start_time_left_by_a_launcher_that_is_not_ours_is_ignored(monkeypatch):
    monkeypatch.setenv(startup.START_VAR, f"{time.time() - 1000:.6f} 1")  # pid 1: never our launcher
    assert abs(startup.command_start() - startup.this_process_start()) < 1e-6
    monkeypatch.setenv(startup.START_VAR, "garbage")
    assert abs(startup.command_start() - startup.this_process_start()) < 1e-6


def test_missing_marks_take_no_time(monkeypatch):
    monkeypatch.delenv(startup.START_VAR, raising=False)
    monkeypatch.setattr(startup, "_marks", {})
    startup.mark("data")
    startup.mark("first_step")
    fields = startup.measure()
    assert fields["startup_rendezvous_s"] == fields["startup_model_s"] == 0
    assert fields["startup_launcher_s"] == 0  # no launcher: the count starts at this process's own start
    assert fields["startup_import_s"] == 0 and fields["startup_data_s"] > 0


def test_process_start_is_when_the_process_started():
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    after = time.time()  # the child was forked between the two readings, however busy the machine is
    try:
        time.sleep(1.0)  # it must be read from a process that has run a while, not at its birth
        started = startup.process_start(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert started is not None and before - 0.05 <= started <= after + 0.05


@pytest.mark.slow
def test_the_first_metrics_line_says_how_long_the_first_step_took(tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    proc = run_cli(
        "train", f"out_dir={out}", "train.epochs=2", "train.max_steps=23", "report.curves=false",
        "--nproc-per-node", "2",
    )  # fmt: skip
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = read_metrics(out)
    assert set(startup.FIELDS) <= set(first) and not set(startup.FIELDS) & set(second)
    assert 0 < first["startup_s"] < wall
    assert sum(first[p] for p in PARTS) == pytest.approx(first["startup_s"], abs=0.01)
    # the count begins at the launcher's start: the workers started after it, and the rendezvous was met
    assert first["startup_launcher_s"] > 0 and first["startup_rendezvous_s"] > 0
    lines = [
        ln for ln in proc.stdout.splitlines() if "from the command's start to the first optimizer step" in ln
    ]
    assert lines == [startup.describe({k: first[k] for k in startup.FIELDS})]
    assert (out / "log.txt").read_text().count("to the first optimizer step") == 1
    # the checkpoint carries the epoch's row as it was before its own save; the line adds that save's stall
    row = load_checkpoint(out / "checkpoints" / "epoch_0001.pt")["metrics_row"]
    assert first["checkpoint_stall_s"] >= row["checkpoint_stall_s"] >= 0
    assert {**row, "checkpoint_stall_s": first["checkpoint_stall_s"]} == first


# ------------------------------------------------------------------------------------------- warm start

# Each worker writes what it sees: its environment, argv, blocked signals, exit path.
_DUMP = textwrap.dedent(
    """
    import json, multiprocessing, os, signal, sys
    def dump(argv):
        path = os.path.join(argv[0], os.environ["RANK"] + ".json")
        with open(path, "w") as fh:
            json.dump({"env": dict(os.environ), "argv": sys.argv[1:],
                       "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                       "unbuffered": type(sys.stdout.buffer).__name__ == "FileIO",
                       "start_method": multiprocessing.get_start_method(allow_none=True)}, fh)
        sys.exit(int(argv[1]))
    if __name__ == "__main__":
        dump(sys.argv[1:])
    """
)

_LAUNCH = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import dumper
    from ddpkit.launcher import elastic, spec, warm_start
    from ddpkit.errors import Failure
    if __name__ == "__main__":  # a forked worker imports the main module again
        out, code = sys.argv[2], sys.argv[3]
        warm_start.start(["torch"])
        launched = spec.LaunchSpec(nproc_per_node=2)
        try:
            elastic.launch_elastic(launched, ["-u", dumper.__file__, out, code], warm=(dumper.dump, [out, code]))
        except Failure as e:
            print("FAILED", e.exit_code, e, flush=True)
        finally:
            warm_start.stop()
    """
)

# Differ from one launch to the next whatever starts the workers.
PER_LAUNCH = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "DDPKIT_START_TIME",
    "DDPKIT_JOB_DIR",  # the launcher's job folder (stack dumps), one per launch
}


def _launch(tmp_path: Path, name: str, warm: bool, code: int = 0) -> tuple[dict, str]:
    (tmp_path / "dumper.py").write_text(_DUMP)
    (tmp_path / "launch.py").write_text(_LAUNCH)
    out = tmp_path / name
    out.mkdir()
    env = cli_env({"DDPKIT_WARM_START": "1" if warm else "0", "MY_VARIABLE": "kept"})
    del env["PYTHONUNBUFFERED"]  # the workers' output is unbuffered by -u (or the warm start's equivalent)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "launch.py"), str(tmp_path), str(out), str(code)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_forked_worker_sees_what_a_worker_started_as_a_program_sees(tmp_path):
    cold, _ = _launch(tmp_path, "cold", warm=False)
    warm, _ = _launch(tmp_path, "warm", warm=True)
    assert sorted(cold) == sorted(warm) == [0, 1]
    for rank in (0, 1):
        a, b = cold[rank], warm[rank]
        env_a = {k: v for k, v in a["env"].items() if k not in PER_LAUNCH | {"DDPKIT_WARM_START"}}
        env_b = {k: v for k, v in b["env"].items() if k not in PER_LAUNCH | {"DDPKIT_WARM_START"}}
        assert env_a == env_b and env_b["MY_VARIABLE"] == "kept" and env_b["RANK"] == str(rank)
        assert "PYTHONUNBUFFERED" not in env_b
        assert a["argv"] == [str(tmp_path / "cold"), "0"] and b["argv"] == [str(tmp_path / "warm"), "0"]
        assert b["blocked"] == a["blocked"] == []  # the fork server's held-back signals are given back
        assert b["unbuffered"] and a["unbuffered"]
        # none chosen yet: the worker's own processes (a DataLoader's workers) are forks of it, not started
        # through a fork server of their own
        assert b["start_method"] == a["start_method"] is None


@pytest.mark.slow
def test_a_forked_worker_exits_with_its_own_status(tmp_path):
    _, said = _launch(tmp_path, "warm", warm=True, code=7)
    assert "FAILED 7 worker rank " in said and "(exit code 7) failed" in said
    assert "Traceback" not in said  # the agent's report stays one line


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_still_checkpoints_and_exits_3(tmp_path):
    out = tmp_path / "run"
    args = ["model.arch=mlp", "data.augment=false", "train.epochs=50", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", f"out_dir={out}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 180
        while not read_metrics(out) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # launcher, fork server and workers alike
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 3, err[-3000:]
    assert "ddpkit: stopped by SIGTERM " in err, err[-3000:]  # the workers' own stop, not just the launcher's
    state = load_checkpoint(out / "checkpoints" / "last.pt")
    # at least the first epoch: 1,438 digits in global batches of 2 x 64
    assert state["step"] >= 1438 // 128 and len(read_metrics(out)) == state["epoch"]


def test_the_warm_start_switch_the_docs_name_turns_warm_starts_off(monkeypatch):
    import re

    from ddpkit import channels
    from ddpkit.launcher import warm_start

    switch = re.findall(r"`(DDPKIT_\w+)=0`", (REPO / "docs" / "launching.md").read_text())
    assert switch == [channels.WARM_START] * len(switch) and switch
    monkeypatch.setenv(channels.WARM_START, "0")
    assert not warm_start.available()
    monkeypatch.setenv(channels.WARM_START, "1")
    assert warm_start.available()  # Linux has the fork server


def test_every_built_in_command_that_runs_on_workers_has_them_forked_with_its_modules_imported():
    """A launch of `train`, `eval`, `info` or `comm` forks its workers from a fork server that imported the
    command's modules once (cli.py), instead of each worker importing torch again."""
    import importlib

    from ddpkit.commands import COMMANDS
    from ddpkit.config import load_config
    from ddpkit.launcher.warm_start import EVERY_WORKER

    cfg = load_config(None, [])
    group = [c for c in COMMANDS.entries() if c.mode == "group" and c.entry.startswith("ddpkit.")]
    assert sorted(c.name for c in group) == ["comm", "eval", "info", "train"]
    for command in group:
        modules = command.hook("preload")(cfg)
        assert modules[: len(EVERY_WORKER)] == EVERY_WORKER and command.module.__name__ in {
            *modules,
            "ddpkit.commands.train",  # the trainer's modules stand for it
        }, command.name
        for name in modules:
            importlib.import_module(name)
