"""Atomic checkpoint files (ddpkit.checkpoint): what save_checkpoint writes, load_checkpoint reads back, files
follow the umask; the checkpoints folder keeps last, best and the newest epoch files and finds the newest
complete one."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import time

import pytest
import torch

from conftest import cli_env
from ddpkit.checkpoint import CheckpointDir, load_checkpoint, save_checkpoint, save_text
from ddpkit.errors import UserError


def test_load_reads_any_dict_save_wrote(tmp_path):
    state = {"step": 3, "weights": {"w": torch.ones(2)}, "note": "no model entry"}
    path = save_checkpoint(state, tmp_path / "state.pt")
    back = load_checkpoint(path)
    assert (
        back["step"] == 3
        and back["note"] == "no model entry"
        and torch.equal(back["weights"]["w"], torch.ones(2))
    )


def test_required_entries_are_checked_only_when_asked(tmp_path):
    path = save_checkpoint({"model": {"w": torch.ones(1)}}, tmp_path / "c.pt")
    with pytest.raises(UserError, match="holds no 'epoch', 'step' entry"):
        load_checkpoint(path, require=("model", "epoch", "step"))
    bad = save_checkpoint({"model": [1, 2], "epoch": 1, "step": 1}, tmp_path / "bad.pt")
    with pytest.raises(UserError, match="not a state dict"):
        load_checkpoint(bad, require=("model", "epoch", "step"))


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        ckpt = save_checkpoint({"a": torch.zeros(1)}, tmp_path / "c.pt")
        text = save_text(tmp_path / "config.yaml", "a: 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(ckpt.stat().st_mode) == mode
    assert stat.S_IMODE(text.stat().st_mode) == mode


def _state(epoch: int, acc: float = 0.0) -> dict:
    return {"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch, "step": 10 * epoch, "acc": acc}


def test_epoch_checkpoints_place_last_and_best_as_copies_and_keep_the_newest(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    for epoch, best in ((1, True), (2, False), (3, True), (4, False)):
        ckpt.save_epoch(_state(epoch), epoch, is_best=best)
    assert [p.name for p in ckpt.epoch_files()] == ["epoch_0004.pt", "epoch_0003.pt"]
    assert load_checkpoint(ckpt.last)["epoch"] == 4 and load_checkpoint(ckpt.best)["epoch"] == 3
    assert ckpt.last.read_bytes() == ckpt.epoch_path(4).read_bytes()
    assert ckpt.last.stat().st_ino != ckpt.epoch_path(4).stat().st_ino  # a copy: editing one spares the other


def test_a_checkpoint_inside_an_epoch_moves_last_and_best_only_when_asked(tmp_path):
    ckpt = CheckpointDir(tmp_path)
    ckpt.save_epoch(_state(1), 1, is_best=True)
    ckpt.save_step({**_state(1), "consumed": 64})
    assert load_checkpoint(ckpt.last)["consumed"] == 64 and "consumed" not in load_checkpoint(ckpt.best)
    ckpt.save_step({**_state(1), "consumed": 96}, is_best=True)  # a run that train.max_steps ends here
    assert load_checkpoint(ckpt.best)["consumed"] == 96
    assert [p.name for p in ckpt.epoch_files()] == ["epoch_0001.pt"]


def test_newest_complete_passes_over_a_damaged_last_and_says_so(tmp_path):
    ckpt = CheckpointDir(tmp_path)
    ckpt.save_epoch(_state(1), 1, is_best=False)
    ckpt.save_epoch(_state(2), 2, is_best=False)
    ckpt.last.write_bytes(b"torn")
    (ckpt.dir / ".last.pt.abc.tmp").write_bytes(b"half a save")
    warnings: list[str] = []
    path, state = ckpt.newest_complete(warn=warnings.append)
    assert path.name == "epoch_0002.pt" and state["epoch"] == 2
    assert len(warnings) == 1 and "last.pt" in warnings[0] and "falling back" in warnings[0]
    assert not list(ckpt.dir.glob("*.tmp"))  # temporaries of killed saves are swept
    assert CheckpointDir(tmp_path / "nothing").newest_complete() is None


SAVER = r"""
import sys, torch
from ddpkit.checkpoint import save_checkpoint
path, i = sys.argv[1], int(sys.argv[2])
while True:
    i += 1
    save_checkpoint({"model": {"w": torch.full((1_000_000,), float(i))}, "step": i}, path)
    print(i, flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_never_leaves_an_unreadable_newest(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    rng = random.Random(7)
    seen = 0
    for _ in range(12):
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, str(path), str(seen)], stdout=subprocess.PIPE, env=cli_env()
        )
        proc.stdout.readline()  # at least one complete save
        time.sleep(rng.uniform(0.0, 0.1))
        proc.kill()
        proc.wait()
        state = load_checkpoint(path)  # raises if unreadable
        assert state["model"]["w"][0].item() == state["step"]
        assert state["step"] > seen  # the newest complete save, never an older one
        seen = state["step"]
    # the temporary files of killed saves are swept when a run next looks for a checkpoint
    CheckpointDir(tmp_path).newest_complete()
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]


def test_save_checkpoint_is_atomic_on_error(tmp_path):
    path = tmp_path / "ck.pt"
    save_checkpoint({"model": {"a": torch.ones(2)}}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        save_checkpoint({"model": {}, "bad": Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["model"]["a"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
