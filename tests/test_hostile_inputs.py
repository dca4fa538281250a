"""Hostile and careless inputs, rounds two and three: files ddpkit did not write are never touched, every reader
is bounded and never waits on a FIFO, every input (config, sizes, the library's arguments) is checked before the
first write, one failure is one line (also from inside a user's script), no rank hangs silently, signals end
every wait, and no process that is not the job's is signalled or left behind.

Time budget: about 90 s for round two on a quiet 2-core machine (one 2-epoch training and one resume of it
shared by the resume tests, one `ddpkit eval` and one `ddpkit run` of 2 workers, the stuck-rank run waits its
10 s straggler timeout, the rest are CLI calls that are refused before any work); round three adds about 150 s
(two 2-worker runs of a script raising a UserError, one of a script starting children, two launchers stopped at
a rendezvous, a dozen one-process CLI calls; the rest in this process).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import QUICK_MLP, REPO, assert_user_error, cli_env, run_cli, run_clis
from ddpkit.checkpoint import CheckpointDir, load_checkpoint, save_checkpoint
from ddpkit.errors import UserError
from ddpkit.train.metrics import RunLog
from ddpkit.train.rundir import check_out_dir

QUICK = QUICK_MLP
ROW = {
    "epoch": 1,
    "step": 5,
    "world_size": 1,
    "global_batch_size": 32,
    "lr": 0.1,
    "train_loss": 1.0,
    "train_acc1": 0.5,
    "val_loss": 1.0,
    "val_acc1": 0.5,
    "val_acc5": 0.9,
    "val_samples": 100,
    "epoch_time_s": 1.0,
    "train_images_per_s": 100.0,
}
DEEP_LINE = "[" * 100_000 + "]" * 100_000


def victim(tmp_path: Path, size: int = 100_000) -> Path:
    """A file outside the run directory that nothing may change."""
    path = tmp_path / "outside" / "victim.bin"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


def fake_run(root: Path, config: str = "seed: 0\n", lines: tuple[str, ...] = ()) -> Path:
    """A run directory as `ddpkit report` reads it: metrics.jsonl (one good epoch, then `lines`), config.yaml."""
    root.mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(f"{x}\n" for x in (json.dumps(ROW), *lines)))
    (root / "config.yaml").write_text(config)
    return root


@pytest.fixture(scope="module")
def finished(finished_mlp) -> Path:
    """A finished 2-epoch run of QUICK (the session's, conftest.finished_mlp); never changed, only copied."""
    return finished_mlp


@pytest.fixture(scope="module")
def resumed(finished, tmp_path_factory):
    """The finished run with foreign, damaged and deeply nested metrics lines and a last.pt whose epoch is a
    string, resumed for a third epoch with curves drawn at the end."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(finished, out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    foreign = ['{"note": "added by hand"}\n', "not json at all\n", DEEP_LINE + "\n", '{"epoch": "two"}\n']
    (out / "metrics.jsonl").write_text("".join(lines[:1] + foreign + lines[1:]))
    last = out / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    save_checkpoint({**state, "epoch": "x"}, last)
    proc = run_cli(
        "train",
        f"out_dir={out}",
        "model.arch=mlp",
        "data.augment=false",
        "report.curves=true",
        "train.epochs=3",
    )
    return proc, out


# ------------------------------------------------------------------------------------------------ symlinks


def test_symlinks_where_ddpkit_writes_leave_the_outside_files_byte_identical(tmp_path):
    target = victim(tmp_path)
    before = target.read_bytes()
    out = tmp_path / "run"
    out.mkdir()
    (out / ".ddpkit.lock").symlink_to(target)
    proc = run_cli("train", f"out_dir={out}", *QUICK, "train.epochs=1")
    assert_user_error(proc, ".ddpkit.lock", "symlink")
    assert target.read_bytes() == before and (out / ".ddpkit.lock").is_symlink()

    outside = tmp_path / "outside" / "ckpts"
    outside.mkdir()
    (outside / ".notes.tmp").write_text("mine")
    (outside / ".last.pt.abcd1234.tmp").write_text("also mine")
    for name, dest in (("log.txt", target), ("metrics.jsonl", target), ("checkpoints", outside)):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        (run / name).symlink_to(dest)
        with pytest.raises(UserError, match="symlink"):
            check_out_dir(run)
    log = RunLog(tmp_path / "run-metrics.jsonl", active=True)
    with pytest.raises(OSError, match="symlink"):  # the write itself refuses too: no check-then-use race
        log.metrics(ROW)
    CheckpointDir(tmp_path / "run-checkpoints").sweep()
    assert target.read_bytes() == before
    assert sorted(p.name for p in outside.iterdir()) == [".last.pt.abcd1234.tmp", ".notes.tmp"]


# ---------------------------------------------------------------------------------------------- user files


def test_files_the_user_owns_are_never_replaced_or_deleted(tmp_path):
    from ddpkit.commands.outputs import check_output

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for name in (".mydata.tmp", ".README.tmp", ".last.pt.q1w2e3r4.tmp"):
        (ckpts / name).write_text(name)
    CheckpointDir(tmp_path / "run").sweep()
    assert sorted(p.name for p in ckpts.iterdir()) == [".README.tmp", ".mydata.tmp"]  # only ddpkit's went

    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text("# my notes on this job\ntrain:\n  epochs: 1\n")
    existing = tmp_path / "existing.sh"
    existing.write_text("#!/bin/sh\necho my own script\n")
    kept = {p: p.read_bytes() for p in (job_yaml, existing)}
    assert_user_error(
        run_cli("slurm", "-c", str(job_yaml), "--script", str(tmp_path / "job.sh"), cwd=tmp_path), "input"
    )
    assert_user_error(run_cli("slurm", "--script", str(existing), cwd=tmp_path), "existing.sh", "--force")
    assert all(p.read_bytes() == b for p, b in kept.items())
    forced = run_cli("slurm", "--script", str(existing), "--force", cwd=tmp_path)
    assert forced.returncode == 0 and "srun" in existing.read_text(), forced.stderr
    check_output(existing, None, "--script")  # ddpkit wrote it now: replaced without --force next time

    run = fake_run(tmp_path / "r")
    (tmp_path / "report.png").write_bytes(b"my picture")
    assert_user_error(run_cli("report", str(run), cwd=tmp_path), "report.png", "--force")
    assert (tmp_path / "report.png").read_bytes() == b"my picture"
    drawn = run_cli("report", str(run), "--out", "new.png", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    check_output(tmp_path / "new.png", ".png", "--out")


# ---------------------------------------------------------------------------------------- bounded readers


def test_a_report_over_an_alias_bomb_config_ends_at_once_with_exit_2(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    run = fake_run(tmp_path / "bomb", config=bomb)
    start = time.monotonic()
    proc = run_cli("report", str(run), "--out", str(tmp_path / "r.png"), timeout=20)
    print(f"refused in {time.monotonic() - start:.2f} s (interpreter start included)")
    assert_user_error(proc, "config.yaml", "aliases")
    assert not (tmp_path / "r.png").exists()


def test_deeply_nested_configs_are_one_line_and_exit_2(tmp_path):
    for name, text in (
        ("list", "seed: " + "[" * 3000 + "]" * 3000 + "\n"),
        ("mapping", "seed: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n"),
    ):
        run = fake_run(tmp_path / name, config=text)
        assert_user_error(
            run_cli("report", str(run), "--out", str(tmp_path / f"{name}.png")), "nested deeper"
        )
    nested: dict = {}
    for _ in range(200):
        nested = {"a": nested}
    path = tmp_path / "deep.pt"
    torch.save({"model": {"w": torch.zeros(1)}, "config": nested}, path)
    with pytest.raises(UserError, match="nested deeper"):
        load_checkpoint(path, require=("model",))


# ---------------------------------------------------------------------------------- half-checked inputs


@pytest.mark.slow
def test_foreign_and_damaged_metrics_lines_never_fail_a_run_that_trained(resumed):
    proc, out = resumed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    text = (out / "metrics.jsonl").read_text()
    assert "added by hand" in text and DEEP_LINE in text  # the user's lines stay where they were
    assert [json.loads(x)["epoch"] for x in text.splitlines() if x.startswith('{"epoch": ')][-1] == 3
    assert (out / "curves.png").is_file()
    report = run_cli("report", str(out), "--out", str(out.parent / "r.png"))
    assert report.returncode == 0, report.stderr
    assert "4 lines" in report.stderr and "skipped" in report.stderr


def test_a_checkpoint_with_wrong_typed_fields_falls_back_to_the_next_good_one(resumed, tmp_path):
    proc, out = resumed
    said = proc.stdout + proc.stderr
    assert "last.pt' is unreadable: its 'epoch' entry is str" in said, said[-3000:]
    assert "resumed from " in said and "epoch_0002.pt" in said
    state = {"model": {"w": torch.zeros(1)}, "epoch": 1, "step": 5, "rng": [{"torch": "garbage"}]}
    torch.save(state, tmp_path / "rng.pt")
    with pytest.raises(UserError, match="'rng' entry"):
        load_checkpoint(tmp_path / "rng.pt", require=("model", "epoch", "step"))


def test_launch_inputs_are_refused_before_any_worker_starts(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    proc = run_cli("run", "--nproc-per-node", "2", "-m", "no.such.module", cwd=tmp_path)
    assert_user_error(proc, "no.such.module")
    assert "[rank" not in proc.stderr and "ran" not in proc.stdout
    for value in ("0", "-5"):
        proc = run_cli("run", "--nproc-per-node", "2", "--rdzv-timeout", value, str(script), cwd=tmp_path)
        assert_user_error(proc, f"--rdzv-timeout must be > 0 seconds, got {value}")
        assert "ran" not in proc.stdout


# ---------------------------------------------------------------------------------------------------- noise


@pytest.mark.slow
def test_a_bad_input_every_worker_finds_is_one_error_line(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    proc = run_cli("eval", "checkpoint.path=bad.pt", "--nproc-per-node", "2", "model.arch=mlp", cwd=tmp_path)
    assert_user_error(proc, "bad.pt", "unreadable")
    assert "api.py" not in proc.stderr, proc.stderr


def test_a_cut_checkpoint_and_a_newline_in_a_flag_each_give_one_clean_line(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"model": {"w": torch.zeros(1000)}, "epoch": 1, "step": 1}, path)
    path.write_bytes(path.read_bytes()[:-10])  # cut inside the zip directory: torch's reader says EINVAL
    with pytest.raises(UserError, match="truncated or damaged") as caught:
        load_checkpoint(path)
    assert "Invalid argument" not in str(caught.value) and "permissions" not in str(caught.value)
    assert_user_error(run_cli("k8s", "--image", "ddpkit:1\nrm -rf /"), "--image")

    from ddpkit.train.rundir import inspect, newest_readable

    out = tmp_path / ("a-long-folder-name-" * 5) / "run"
    (out / "checkpoints").mkdir(parents=True)
    for name in ("last.pt", "epoch_0002.pt", "epoch_0001.pt"):
        (out / "checkpoints" / name).write_bytes(b"garbage")
    with pytest.raises(UserError) as none_loads:
        newest_readable(out, inspect(out), warn=print)
    what = none_loads.value.what
    assert what.count(str(out)) == 1 and len(what) - len(str(out)) < 200, what  # path once, reason once


# ---------------------------------------------------------------------------------------------------- hangs

STUCK = REPO / "tests" / "scripts" / "stuck_rank.py"  # docs/reliability.md shows it as stuck.py


class Lines:
    """A process's merged output, line by line, with each line's arrival time."""

    def __init__(self, proc: subprocess.Popen):
        self.got: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.got.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.got):
                if text in line:
                    return t
            if not self._thread.is_alive():  # the output ended: it will not come
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not seen within {timeout} s:\n" + "\n".join(x for _, x in self.got))

    def text(self) -> str:
        return "\n".join(x for _, x in self.got)


@pytest.mark.slow
def test_a_stuck_rank_is_named_with_its_stack_and_stacks_can_be_asked_for(tmp_path):
    shutil.copy(STUCK, tmp_path / "stuck.py")
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--nproc-per-node",
        "2",
        "--straggler-timeout",
        "10",
        "stuck.py",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = Lines(proc)
    try:
        done = out.wait_for("rank 0 done", 120)
        named = out.wait_for("still running", 30)
        assert named - done < 20, out.text()
        out.wait_for("[rank1]:   File", 5)
        report = [x for x in out.text().splitlines() if "still running" in x][0]
        assert "rank 1 still running 10 s after rank 0 ended" in report
        assert 'stuck.py", line 7 in wait_forever' in out.text()

        asked = run_cli("stacks", str(proc.pid), timeout=60)  # from another shell, while rank 1 still waits
        assert asked.returncode == 0, asked.stderr
        assert "[rank1]:" in asked.stdout and "wait_forever" in asked.stdout
        proc.send_signal(signal.SIGUSR2)  # the same on the launcher's own stderr
        out.wait_for("(SIGUSR2)", 30)
        assert out.text().count("still running") == 1  # named once, and the job keeps waiting
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)  # passed on: the script does not handle it and ends
        proc.wait(timeout=60)
    assert proc.returncode != 0


ARMED = """
import os, sys, time
from ddpkit.diagnostics import stacks
stacks.arm()
def waiting_rank():
    time.sleep(600)
if os.environ["RANK"] == "1":
    waiting_rank()
"""


def test_straggler_action_stop_ends_the_ranks_still_running_after_naming_them(tmp_path):
    from ddpkit.diagnostics.stacks import Watch

    said: list[str] = []
    with Watch(timeout_s=1, action="stop", say=lambda text, **_: said.append(text)) as watch:
        env = cli_env()  # the job folder travels in the environment, as to a launcher's workers
        ranks = [
            subprocess.Popen([sys.executable, "-c", ARMED], env={**env, "RANK": str(r)}, cwd=tmp_path)
            for r in (0, 1)
        ]
        assert ranks[0].wait(timeout=60) == 0
        assert ranks[1].wait(timeout=60) == -signal.SIGKILL  # ended by the watch, not by this test
    assert watch.stopped == [1] and len(said) == 1, said
    assert "rank 1 still running 1 s after rank 0 ended; ending them" in said[0]
    assert "[rank1]:" in said[0] and "waiting_rank" in said[0]
    assert not watch.job.exists()  # the job folder goes with the launch


# ---------------------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.n_embd=1000000000", "model.n_head=1"], "model.n_embd"),
        (["model.n_layer=1000000000"], "model.n_layer"),
        (["model.n_layer=100000"], "model.n_layer"),
        (["model.n_layer=1000", "model.n_embd=8192", "model.n_head=8"], "make model.n_layer smaller"),
        (["model.n_embd=65536", "model.n_head=1"], "make model.n_embd smaller"),
        (["train.batch_size=100000", "data.block_size=100000"], "train.batch_size or data.block_size"),
    ],
)
def test_a_model_too_large_for_the_machine_is_refused_before_anything_is_built(overrides, key):
    from ddpkit.config import load_config
    from ddpkit.models import check_arch

    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        check_arch(load_config(overrides=["model.arch=gpt", "data.dataset=text", *overrides]))


def test_a_huge_gpt_is_one_line_at_once(tmp_path):
    (tmp_path / "t.txt").write_text("abc\n" * 1000)
    start = time.monotonic()
    proc = run_cli(
        "train",
        "model.arch=gpt",
        "data.dataset=text",
        f"data.root={tmp_path / 't.txt'}",
        "model.n_layer=500",
        "model.n_embd=16384",
        "model.n_head=16",
        f"out_dir={tmp_path / 'run'}",
        "--nproc-per-node",
        "2",
    )
    assert_user_error(proc, "model.n_layer=500", "GiB", "make model.n_layer smaller")
    assert time.monotonic() - start < 60 and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ FIFOs where a file is expected


def dcp_folder(root: Path) -> Path:
    """A one-tensor sharded checkpoint written by this process: (its folder)."""
    ckpts = CheckpointDir(root, sharded=True)
    ckpts.save_sharded(
        {"model.w": torch.arange(6.0)}, {"epoch": 1, "step": 1, "consumed": 0}, is_main=True, is_best=False
    )
    return ckpts.last


def test_a_fifo_inside_a_sharded_checkpoint_is_one_line_not_a_wait(tmp_path):
    from ddpkit.checkpoint.sharded import read_model

    last = dcp_folder(tmp_path)
    assert read_model(last)["w"].tolist() == list(range(6))
    shard = next(last.glob("*.distcp"))
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(UserError, match=f"its shard {shard.name} is a FIFO"):
        read_model(last)
    (last / ".metadata").unlink()
    os.mkfifo(last / ".metadata")
    proc = run_cli("eval", f"checkpoint.path={last}", timeout=60)  # blocked forever before
    assert_user_error(proc, str(last), ".metadata is a FIFO")


def test_a_fifo_as_the_text_data_is_one_line_not_a_wait(tmp_path):
    """data.dataset=text: a FIFO as data.root, inside a data.root folder, or put where a file was after it was
    listed, is one line naming it (a plain open() of a FIFO waits for a writer forever)."""
    import threading

    from ddpkit.config import load_config
    from ddpkit.data import text

    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("some text " * 50)
    os.mkfifo(folder / "b.txt")
    outcome: dict = {}

    def read_all():
        for root, fragment in [
            (fifo, "corpus.txt' is a FIFO, not a file or a folder"),
            (folder, "b.txt' is a FIFO"),
        ]:
            cfg = load_config(None, ["data.dataset=text", f"data.root={root}", "data.block_size=8"])
            with pytest.raises(UserError, match=re.escape(fragment)):
                text.read_text(cfg)
        with pytest.raises(UserError, match=re.escape("corpus.txt' is a FIFO, not a text file")):
            text._read_one(fifo, 100)  # what read_text opens once it has listed the files
        outcome["done"] = True

    worker = threading.Thread(target=read_all, daemon=True)  # a wait would block the thread, not the suite
    worker.start()
    worker.join(timeout=30)
    assert outcome.get("done"), "reading a FIFO as text waited (or failed: see the thread's exception)"


def test_a_fifo_named_as_an_output_or_a_script_is_one_line_not_a_wait(tmp_path):
    from ddpkit.commands.outputs import check_output

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    for force in (False, True):
        with pytest.raises(UserError, match="--json '.*out.json' is a FIFO, not a file"):
            check_output(fifo, ".json", "--json", force)
    script, job = tmp_path / "train.py", tmp_path / "job.sh"
    os.mkfifo(script)
    os.mkfifo(job)
    existing = tmp_path / "mine.json"
    existing.write_text("kept")
    procs = run_clis(
        ["run", str(script)],
        ["report", str(tmp_path), "--json", str(fifo)],
        ["bench", "--nproc", "2", "--json", str(fifo)],
        ["bench", "--nproc", "2", "--json", str(fifo), "--force"],  # --force replaces files, never a FIFO
        ["bench", "--nproc", "2", "--json", str(existing)],
        ["slurm", "--script", str(job)],
        ["slurm", "--script", str(job), "--force"],
        timeout=60,  # a wait on a FIFO fails this test, not the suite
    )
    assert_user_error(procs[0], "train.py' is a FIFO")
    assert_user_error(procs[1], "out.json' is a FIFO")
    for bench in procs[2:4]:
        assert_user_error(bench, "--json '", "out.json' is a FIFO, not a file")
    assert_user_error(procs[4], "mine.json' exists and ddpkit did not write it", "--force")
    for slurm in procs[5:7]:
        assert_user_error(slurm, "--script '", "job.sh' is a FIFO, not a file")
    assert existing.read_text() == "kept"


# ------------------------------------------------------------------------------- the library's arguments


def _plans():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return [{"l2": "colwise"}, {"l2": 1}, {"l2": ColwiseParallel}, "l2", {3: ColwiseParallel()}]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        *[({"tp": 2, "tp_plan": plan}, "tp_plan") for plan in _plans()],
        ({"tp": "2"}, "tp must be a whole number >= 1, not a str"),
        ({"tp": 2.5}, "tp must be a whole number >= 1"),
        ({"tp": True}, "tp must be a whole number"),
        ({"pp": 0}, "pp must be a whole number >= 1"),
        ({"pp": 2, "loss_fn": "mse"}, "loss_fn must be a function"),
        ({"pp_microbatches": 0}, "pp_microbatches"),
        ({"seed": "0"}, "seed must be a whole number"),
        ({"roles": "train"}, "roles must be a list of names"),
        ({"strategy": None}, "strategy must be a name"),
        ({"memory": "small"}, "memory must be 'fast' or 'lean'"),
        (
            {"memory": "lean"},
            "prepare(memory='lean') shards each block's parts with FSDP2, which single does not",
        ),
    ],
)
def test_prepare_checks_each_argument_before_anything_is_made(kwargs, fragment):
    import ddpkit

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match=re.escape(fragment)):
        ddpkit.prepare(model, **kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"nprocs": 10**6}, "nprocs must be a whole number from 1 to 1024, got 1000000"),
        ({"nprocs": True}, "got True"),
        ({"nprocs": 2.0}, "got 2.0"),
        ({"nprocs": 2, "timeout_s": 0}, "timeout_s must be a number of seconds > 0, got 0"),
        ({"nprocs": 2, "timeout_s": float("inf")}, "timeout_s"),
        ({"nprocs": 2, "backend": "mpi "}, "backend must be one of"),
        ({"nprocs": 2, "start_method": "vfork"}, "start_method"),
    ],
)
def test_launch_checks_each_argument_before_any_process_starts(kwargs, fragment):
    import ddpkit

    with pytest.raises(UserError, match=re.escape(fragment)):
        ddpkit.launch(print, **kwargs)
    with pytest.raises(UserError, match="fn must be a function"):
        ddpkit.launch("print", nprocs=1)


# ------------------------------------------------------------------------------------ control characters


@pytest.mark.parametrize("char", ["\x1b", "\x7f", "\x01", "\x9b"])
def test_control_characters_in_a_value_or_a_config_file_are_one_line(tmp_path, char):
    from ddpkit.config import load_config

    with pytest.raises(
        UserError, match=re.escape(f"the value of out_dir holds a control character ({char!r})")
    ):
        load_config(overrides=[f"out_dir=runs/a{char}b"])
    config = tmp_path / "c.yaml"
    config.write_text(f"seed: 1\nout_dir: a{char}b\n")
    with pytest.raises(UserError, match=re.escape(f"holds a control character ({char!r}) at line 2")):
        load_config(str(config))


def test_a_line_break_in_a_value_is_refused_not_folded_into_a_space():
    from ddpkit.config import load_config

    for raw in ("runs/a\nb", "runs/a\rb"):
        with pytest.raises(UserError, match="the value of out_dir holds a line break"):
            load_config(overrides=[f"out_dir={raw}"])


def test_paths_in_error_lines_are_printed_with_their_control_characters_escaped(tmp_path):
    evil = "x\x1b]0;owned\x07\x1b[2J"
    proc = run_cli("report", str(tmp_path / evil))
    line = assert_user_error(proc, r"x\x1b]0;owned\x07\x1b[2J")
    assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, line
    assert UserError(f"'{evil}'", "hint").line() == r"'x\x1b]0;owned\x07\x1b[2J' (hint)"


def test_the_one_process_strategy_dp_is_refused_with_tensor_parallel():
    from ddpkit.parallel.mesh import layout_of
    from ddpkit.parallel.plan import strategy_over_dp

    with pytest.raises(UserError, match="dist.strategy=dp runs one process, not the 2 ranks of dist.tp=2"):
        strategy_over_dp("dp", layout_of(2, 2))
    assert strategy_over_dp("single", layout_of(2, 2)) == "single"


def test_a_reader_that_stops_early_is_not_a_disk_error():
    proc = subprocess.run(
        f"{sys.executable} -m ddpkit k8s | head -1",
        shell=True,
        capture_output=True,
        text=True,
        env=cli_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}),
        executable="/bin/bash",
        timeout=120,
    )
    assert proc.stdout.startswith("# Written by `ddpkit k8s`") and proc.stderr == "", proc.stderr


def test_a_hard_linked_log_is_found_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    other = victim(tmp_path, 10)
    os.link(other, out / "log.txt")
    proc = run_cli("train", f"out_dir={out}", *QUICK)
    assert_user_error(proc, "log.txt' is a file with other hard links")
    assert sorted(p.name for p in out.iterdir()) == ["log.txt"]


# ------------------------------------------------------------------------------- processes that are not ours


def test_stacks_never_signals_a_process_that_took_a_stale_job_folders_pids(tmp_path, monkeypatch):
    import tempfile

    from ddpkit.commands.stacks import stacks_command
    from ddpkit.diagnostics.stacks import JOB_PREFIX, LAUNCHER_FILE, identity, proven

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # an unrelated process of this user that got the pids a SIGKILLed launcher and its rank had recorded
    other = subprocess.Popen(["sleep", "60"])
    try:
        stale = tmp_path / f"{JOB_PREFIX}{other.pid}-abc"
        stale.mkdir()
        (stale / LAUNCHER_FILE).write_text(f"{other.pid} 12345-0000000000000000")
        (stale / "rank0.pid").write_text(f"{other.pid} 12345-0000000000000000")
        with pytest.raises(UserError, match="no ddpkit launcher"):
            stacks_command([])
        assert other.poll() is None, "SIGUSR2 reached an unrelated process"
        assert not stale.exists()
        mine = tmp_path / "me.pid"
        mine.write_text(f"{other.pid} {identity(other.pid)}")
        assert proven(mine) == other.pid  # the same process, recorded by itself, is proven
    finally:
        other.kill()
        other.wait()


# ---------------------------------------------------------------------------- ddpkit's errors inside a script


@pytest.mark.slow
def test_a_user_error_raised_inside_a_script_is_one_line_for_the_job(tmp_path):
    """... and a warning of torch's that every rank gives is printed once for the job, one that a single rank
    gives still once."""
    script = tmp_path / "bad_prepare.py"
    script.write_text(
        "import os, warnings\nimport torch\nimport ddpkit\n\n"
        "torch.tensor(torch.ones(1))  # torch's UserWarning, on every rank\n"
        "if os.environ['RANK'] == '1':\n    warnings.warn('rank 1 alone')\n"
        "ddpkit.prepare(torch.nn.Linear(2, 2), tp='2')\n"
    )
    launchers = ("torchrun", "spawn")  # spawn: torch's "Terminating process" warning is not repeated
    jobs = (["run", "--launcher", launcher, "--nproc-per-node", "2", str(script)] for launcher in launchers)
    for proc in run_clis(*jobs, cwd=tmp_path):  # the two jobs at once
        assert_user_error(proc, "ddpkit.prepare(tp='2'): tp must be a whole number")
        assert "[rank" not in proc.stderr and "Terminating process" not in proc.stderr, proc.stderr
        assert proc.stderr.count("UserWarning: To copy construct from a tensor") == 1, proc.stderr
        assert proc.stderr.count("UserWarning: rank 1 alone") == 1, proc.stderr


def test_every_ranks_warnings_are_shown_again_with_warnings_per_rank(tmp_path, monkeypatch):
    """DDPKIT_WARNINGS_PER_RANK=1 gives back torch's way: a worker shows a warning another rank of the job
    already showed (the claims between real workers: the test above and test_porting.py's launch test)."""
    import warnings

    from ddpkit import channels
    from ddpkit.diagnostics import warn_once

    for per_rank, copies in (("0", 1), ("1", 2)):
        seen: list[str] = []
        monkeypatch.setattr(
            warnings, "showwarning", lambda message, *rest, seen=seen: seen.append(str(message))
        )
        monkeypatch.setenv(channels.WARNINGS_PER_RANK, per_rank)
        warn_once.install(str(tmp_path / per_rank))
        # the second show stands for another rank of the job: it finds the warning claimed in the folder
        for _ in range(2):
            warnings.showwarning("the same on every rank", UserWarning, "x.py", 1)
        assert seen == ["the same on every rank"] * copies, per_rank


# ------------------------------------------------------------------------------------- signals in every wait


def catches(pid: int, signum: int) -> bool:
    """Process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_launcher_waiting_for_other_nodes_at_once(tmp_path, signum):
    from ddpkit.launcher.launch import free_port

    (tmp_path / "hi.py").write_text("print('ran')\n")
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--nproc-per-node",
        "1",
    ]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--rdzv-timeout", "300", "hi.py"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not catches(proc.pid, signal.SIGTERM):  # the launcher's forwarder is in place: it is waiting
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.poll() else ""
            )
            time.sleep(0.1)
        sent = time.monotonic()
        proc.send_signal(signum)
        proc.wait(timeout=20)  # before: only SIGKILL ended it
        assert time.monotonic() - sent < 10
    finally:
        proc.kill()
        proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 128 + signum, err
    assert (
        f"received {signal.Signals(signum).name} before any worker started" in err and "Traceback" not in err
    )


# ------------------------------------------------------------------------------------ a job's process tree

KIDS = """import os, subprocess, sys
child = subprocess.Popen(["sleep", "300"])
forked = os.fork()
if forked == 0:
    os.execvp("sleep", ["sleep", "301"])
with open(sys.argv[1] + "." + os.environ["RANK"], "w") as f:
    f.write(f"{child.pid} {forked}")
"""


@pytest.mark.slow
def test_children_a_script_starts_end_with_the_job(tmp_path):
    (tmp_path / "kids.py").write_text(KIDS)
    proc = run_cli("run", "--nproc-per-node", "2", "kids.py", str(tmp_path / "pids"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(p) for f in tmp_path.glob("pids.*") for p in f.read_text().split()]
    try:
        assert len(pids) == 4
        left = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]
        ]
        assert left == [], "processes the script started outlived the job"
    finally:
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------------------- checkpoint errors name the thing


def test_sharded_checkpoint_errors_name_the_file_the_tensor_and_both_shapes(tmp_path):
    from conftest import dist_context
    from ddpkit.checkpoint.sharded import read_model
    from ddpkit.parallel.strategy import Strategy
    from ddpkit.train.builders import load_weights

    last = dcp_folder(tmp_path)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(7))
    with pytest.raises(UserError) as caught:  # eval: no optimizer, and advice about eval's settings
        load_weights(Strategy(dist_context(0, 1)), model, {}, last, "mlp")
    line = caught.value.line()
    assert "tensor 'model.w' has shape [6] in the checkpoint and [7] in this model" in line
    assert "checkpoint.path" in line and "out_dir" not in line and "CheckpointException" not in line
    shard = next(last.glob("*.distcp"))
    size = shard.stat().st_size
    for damage, fragment in [
        (
            b"\0" * size,
            f"its shard {shard.name} of {last} read by rank 0 is damaged: it is not a torch.save file",
        ),
        (shard.read_bytes()[: size // 2], f"its shard {shard.name} holds {size // 2} bytes"),
        (None, f"its shard {shard.name} is missing"),
    ]:
        if damage is None:
            shard.unlink()
        else:
            shard.write_bytes(damage)
        with pytest.raises((UserError, ValueError), match=re.escape(fragment)):
            read_model(last)


SIZE_LIMITED_SAVE = """import resource, signal, sys, torch
from pathlib import Path
from ddpkit.checkpoint import CheckpointDir
from ddpkit.errors import describe_os_error
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
ckpts = CheckpointDir(Path(sys.argv[1]), sharded=True)
try:
    ckpts.save_sharded({"model.w": torch.zeros(100000)}, {"epoch": 1, "step": 1, "consumed": 0}, True, False)
except OSError as e:
    print(" / ".join(describe_os_error(e)))
"""


def test_a_sharded_save_that_runs_out_of_room_names_the_folder(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SIZE_LIMITED_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert proc.stdout.startswith(
        f"file too large writing '{tmp_path / 'checkpoints' / 'epoch_0001.dcp'}'"
    ), (
        proc.stdout,
        proc.stderr[-2000:],
    )
