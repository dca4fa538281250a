"""Atomic checkpoint files: what save_checkpoint writes, load_checkpoint reads back; files follow the umask."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from ddpkit.checkpoint import load_checkpoint, save_checkpoint, save_text
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
