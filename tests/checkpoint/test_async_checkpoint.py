"""checkpoint.async_save=true: sharded checkpoints staged at their step and written in the background
(torch.distributed.checkpoint.async_save).

- A run SIGKILLed at random moments while background saves are in flight, and rerun, ends with the weights of the
  unbroken run; after every kill the newest complete checkpoint is readable and never older than the one before;
  a SIGTERM waits for the save in flight and its own, and the checkpoint holds the step it stopped at (one process
  with torch imported forks each run: tests/checkpoint/test_checkpoint.py's saver).
- On 2 pooled ranks (fsdp): 3 steps saved in the background at every step, continued by a second run to 6 steps,
  equal the unbroken one-process run; the checkpoint is complete when fit() returns; every metrics line has its
  checkpoint_stall_s.
- `Saves` keeps one save in flight, times the waits (for the write, and for the staging before an optimizer step)
  and raises a background save's error in the training thread; checkpoint.format=full is refused in one line
  before anything starts.
- A save whose staging is made slow while the next epoch's forward passes (batch norm statistics) and optimizer
  steps run holds its epoch's state bit for bit as the blocking save does (one process, in this one).

Time budget: about 30 s on a quiet 2-core machine (a forking process's start, five short one-process runs forked
from it, a one-process reference in this process, two runs of a small CNN in this process, a 2-rank group of two
short runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from conftest import (
    GPT_RUN,
    REPO,
    cli_env,
    dist_context,
    metrics_rows,
    plain,
    run_group,
    train_here,
    wait_for,
)
from ddpkit.checkpoint import CheckpointDir, load_checkpoint
from ddpkit.checkpoint.background import Saves, check_async_save
from ddpkit.checkpoint.sharded import read_model
from ddpkit.config import load_config
from ddpkit.errors import UserError

ASYNC = ["checkpoint.format=sharded", "checkpoint.async_save=true", "checkpoint.every_steps=1"]
RUN = [*GPT_RUN, "train.batch_size=8", "optim.lr=0.05"]  # a loss that stays finite for 22 steps


def _assert_close(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(got[k]), ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, gpt_text) -> dict[int, dict[str, torch.Tensor]]:
    """The one-process runs of RUN with nothing interrupted, to 6 and to 22 steps (one epoch is 23): {steps: full weights}."""
    out = {}
    for steps in (6, 22):
        run = tmp_path_factory.mktemp(f"unbroken{steps}") / "run"
        train_here(*RUN, f"train.max_steps={steps}", f"out_dir={run}", f"data.root={gpt_text}")
        out[steps] = load_checkpoint(run / "checkpoints" / "last.pt")["model"]
    return out


# ------------------------------------------------------------------------------------------ in-process


def test_async_save_is_for_sharded_checkpoints_and_said_in_one_line():
    from ddpkit.commands.train import check_inputs

    check_async_save(load_config(None, ["checkpoint.async_save=true", "checkpoint.format=sharded"]))
    with pytest.raises(UserError) as e:
        check_inputs(load_config(None, ["checkpoint.async_save=true"]))  # what the command checks first
    assert e.value.line() == (
        "checkpoint.async_save=true writes sharded checkpoints, not checkpoint.format=full (add "
        "checkpoint.format=sharded (each rank writes its shards in the background), or drop async_save)"
    )


def test_saves_keep_one_in_flight_time_its_wait_and_raise_its_error_here():
    saves, release = Saves(background=True), threading.Event()
    saves.start(lambda: release.wait(5))
    with pytest.raises(RuntimeError, match="already in flight"):
        saves.start(lambda: None)
    threading.Timer(0.2, release.set).start()
    saves.wait()  # blocked until the save ended: stall time
    assert not saves.in_flight and saves.take() >= 0.15 and saves.take() == 0.0

    def fails():
        raise OSError(28, "No space left on device", "last.dcp")

    saves.start(fails)
    with pytest.raises(OSError, match="No space left on device"):
        saves.wait()
    saves.wait()  # the error is raised once; nothing in flight now

    staging = Future()  # the stager's copies, made while the next forward and backward run
    saves.start(lambda: staging.result(), staging)
    threading.Timer(0.2, staging.set_result, (None,)).start()
    saves.staged()  # before the optimizer step: blocked until staged, stall time too
    assert staging.done() and saves.in_flight and saves.take() >= 0.15
    saves.staged()  # seen done once: nothing to wait for
    saves.wait()
    assert saves.take() < 0.15


def test_a_background_save_is_complete_when_waited_for_and_places_nothing_once_abandoned(tmp_path):
    ckpts, side = CheckpointDir(tmp_path, sharded=True), {"epoch": 0, "step": 3, "consumed": 24}
    saves = Saves(background=True)
    w = torch.arange(6.0)
    ckpts.save_sharded({"model.w": w}, side, True, False, background=saves)
    w.add_(100)  # training goes on: the save holds the step's values, staged
    saves.wait()
    assert (
        torch.equal(read_model(ckpts.last)["w"], torch.arange(6.0))
        and load_checkpoint(ckpts.last)["step"] == 3
    )
    saves.abandon()  # a failed run: what is in flight is written into its temporary folder, placed nowhere
    ckpts.save_sharded({"model.w": w}, {**side, "step": 4}, True, False, background=saves)
    saves.wait()
    assert load_checkpoint(ckpts.last)["step"] == 3 and len(list(ckpts.dir.glob(".last.dcp.*.tmp"))) == 1


def test_host_copies_are_made_once_and_hold_each_save_apart_from_later_changes():
    from ddpkit.checkpoint.host_copies import HostCopies

    stager, w, step = HostCopies(), torch.arange(4.0), torch.tensor(3.0)
    first = stager.stage({"w": w, "step": step}).result()
    assert torch.equal(first["w"], torch.arange(4.0)) and first["step"].item() == 3.0
    assert first["w"].data_ptr() != w.data_ptr()
    w.add_(1)
    again = stager.stage({"w": w, "step": step}).result()  # the same memory, this save's values
    assert again["w"].data_ptr() == first["w"].data_ptr() and torch.equal(again["w"], torch.arange(1.0, 5.0))
    w.add_(1)  # training goes on after staging: the copies keep the save's values
    assert torch.equal(again["w"], torch.arange(1.0, 5.0))
    assert torch.equal(
        stager.stage({"w": torch.ones(6)}).result()["w"], torch.ones(6)
    )  # new shapes: new copies
    stager.close()


def _folder_tensors(path, into) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, into)
    return torch.load(into, weights_only=True)


def test_a_save_staged_while_the_next_steps_run_equals_the_blocking_save_bit_for_bit(tmp_path, monkeypatch):
    """The stager made slow: the next epoch's forward passes (which change batch norm's running statistics) and
    its optimizer steps come while epoch 1's save is being staged, and that save holds epoch 1's state exactly."""
    from ddpkit.checkpoint.host_copies import HostCopies

    run = [
        "model.arch=cnn", "data.dataset=synthetic", "data.synthetic_size=64", "data.synthetic_val_size=16",
        "data.image_size=8", "data.augment=false", "train.batch_size=16", "optim.name=adamw", "train.epochs=2",
        "checkpoint.format=sharded", "report.curves=false",
    ]  # fmt: skip
    train_here(*run, f"out_dir={tmp_path / 'blocking'}")
    stage, staged = HostCopies._stage, []
    monkeypatch.setattr(
        HostCopies, "_stage", lambda self, sd: staged.append(1) or time.sleep(0.5) or stage(self, sd)
    )
    train_here(*run, "checkpoint.async_save=true", f"out_dir={tmp_path / 'async'}")
    # epoch 1's save in the background; the run's last one written as a blocking save (nothing left to overlap)
    assert len(staged) == 1
    for epoch in ("epoch_0001.dcp", "epoch_0002.dcp"):
        ref, got = (
            _folder_tensors(tmp_path / mode / "checkpoints" / epoch, tmp_path / f"{mode}{epoch}.pt")
            for mode in ("blocking", "async")
        )
        assert sorted(got) == sorted(ref) and any("running_mean" in k for k in ref)
        assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], epoch
        steps = [
            load_checkpoint(tmp_path / mode / "checkpoints" / epoch)["step"] for mode in ("blocking", "async")
        ]
        assert steps[0] == steps[1] == 4 * int(epoch[6:10])
    # epoch 2's first optimizer step waited for epoch 1's staging (0.5 s): stall time
    assert [r["checkpoint_stall_s"] >= 0.3 for r in metrics_rows(tmp_path / "async")] == [False, True]


# ----------------------------------------------------------------------------- 2 ranks, in the background


def _two_runs(rank: int, world_size: int, out: str, text: str) -> dict:
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    steps = {}
    for max_steps in (3, 6):  # the second run continues from the first one's last checkpoint
        keys = [*RUN, "train.batch_size=4", "dist.strategy=fsdp", *ASYNC, f"train.max_steps={max_steps}"]
        cfg = load_config(None, [*keys, f"out_dir={out}", f"data.root={text}"])
        with Heartbeat(rank, world_size) as heartbeat:
            trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
            trainer.fit()
            # complete when fit() returns: last.dcp holds this run's last step
            steps[max_steps] = load_checkpoint(f"{out}/checkpoints/last.dcp")["step"]
            weights = plain(trainer.strategy.model_state(trainer.wrapped))
    return {"steps": steps, "weights": weights}


@pytest.mark.slow
def test_background_saves_on_two_ranks_resume_exactly(unbroken, gpt_text, tmp_path):
    out = tmp_path / "run"
    ranks = run_group(_two_runs, 2, str(out), str(gpt_text), timeout=300)
    assert ranks[0]["steps"] == ranks[1]["steps"] == {3: 3, 6: 6}
    _assert_close({k: torch.from_numpy(v) for k, v in ranks[0]["weights"].items()}, unbroken[6])
    _assert_close(read_model(out / "checkpoints" / "last.dcp"), unbroken[6])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1] and rows[0]["checkpoint_stall_s"] > 0
    assert not list((out / "checkpoints").glob(".*"))  # no temporary left by a finished run


# ------------------------------------------------------------------------- SIGKILL during background saves

# One process imports torch and what a worker needs once (as a launch's fork server does) and forks one run per line it reads: the child writes its pid,
# runs `ddpkit train`'s Trainer (resuming from the newest complete checkpoint), and the parent writes
# `ended STATUS MESSAGE` once it is gone (each line one write(2), see test_checkpoint.py's saver).
FORKER = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import importlib
from conftest import train_here
from ddpkit.commands.train import preload
from ddpkit.config import load_config
for module in preload(load_config(None, sys.argv[2:])):  # what a launch's fork server imports for its workers
    importlib.import_module(module)
for line in sys.stdin:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(1, f"{os.getpid()}\n".encode())
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the run's own lines: not into the parent's pipe
        try:
            train_here(*sys.argv[2:])
            code = 0
        except BaseException as e:
            os.write(w, str(e).splitlines()[0].encode()[:500])
            code = 1
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    said = os.read(r, 1000).decode()
    os.close(r)
    os.write(1, f"ended {status} {said}\n".encode())
"""


def _newest_step(out) -> int:
    found = CheckpointDir(out, sharded=True).newest_complete(warn=lambda line: None)
    return found[1]["step"] if found else 0


@pytest.mark.slow
def test_sigkill_at_random_moments_during_background_saves_then_rerun_equals_unbroken(
    unbroken, gpt_text, tmp_path
):
    out, rng = tmp_path / "run", random.Random(11)
    args = [*RUN, *ASYNC, "train.max_steps=22", f"out_dir={out}", f"data.root={gpt_text}"]
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, str(REPO / "tests"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )

    def run(kill=None) -> str:
        """One run: `kill` it (a signal) at a random moment once it has written a checkpoint of its own."""
        seen = _newest_step(out)
        forker.stdin.write("go\n")
        forker.stdin.flush()
        pid = int(forker.stdout.readline())
        if kill is not None:
            # 22 steps leave room for 3 runs to be stopped mid-way: on a quiet machine a run makes several
            # steps between its first new checkpoint and the kill (12 steps were all made by the second run)
            assert seen < 20, f"the runs got to step {seen} before the kills: give them more steps"
            wait_for(lambda: _newest_step(out) > seen, timeout=120, proc=forker)
            time.sleep(rng.uniform(0.0, 0.3))
            flights.append(any((out / "checkpoints").glob(".last.dcp.*.tmp")))  # a save in flight
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, kill)
        ended = forker.stdout.readline()
        step = _newest_step(out)  # the newest complete checkpoint reads, and is never an older one
        assert step >= seen, (step, seen)
        return ended

    flights: list[bool] = []
    try:
        for _ in range(2):
            run(signal.SIGKILL)
        # a stop waits for the save in flight, then writes and waits for its own
        stopped = run(signal.SIGTERM)
        at = re.search(r"stopped by SIGTERM at step (\d+)", stopped)
        assert at and _newest_step(out) == int(at.group(1)), stopped
        assert run().startswith("ended 0 ")
    finally:
        forker.kill()
        forker.wait()
    assert sum(flights) >= 2, flights  # most kills came while a background save was being written
    _assert_close(read_model(out / "checkpoints" / "last.dcp"), unbroken[22])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1]
