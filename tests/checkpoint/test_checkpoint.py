"""Atomic checkpoint files (ddpkit.checkpoint): what save_checkpoint writes, load_checkpoint reads back, files
follow the umask; the checkpoints folder keeps last, best and the newest epoch files and finds the newest
complete one."""

from __future__ import annotations

import os
import random
import signal
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
    (ckpt.dir / ".last.pt.abc12345.tmp").write_bytes(b"half a save")  # as mkstemp names it
    warnings: list[str] = []
    path, state = ckpt.newest_complete(warn=warnings.append)
    assert path.name == "epoch_0002.pt" and state["epoch"] == 2
    assert len(warnings) == 1 and "last.pt" in warnings[0] and "falling back" in warnings[0]
    assert list(ckpt.dir.glob("*.tmp"))  # looking writes nothing: a run sweeps once it owns out_dir
    ckpt.sweep()
    assert not list(ckpt.dir.glob("*.tmp"))  # temporaries of killed saves are swept
    assert CheckpointDir(tmp_path / "nothing").newest_complete() is None


# A process that imports torch once and forks one saver per trial (a fork starts in milliseconds, a new process
# in seconds): each saver writes checkpoints in a loop, printing `PID STEP` after each complete save, until the
# test SIGKILLs it; the forking process then reaps it and prints `killed`. Each line is one write(2): print()
# under PYTHONUNBUFFERED writes "PID", " ", "STEP" and "\n" apart, and a saver killed between two of them left a
# line without its end, to which `killed` was joined: the test then waited for a `killed` line forever.
SAVER = r"""
import os, sys, torch
from ddpkit.checkpoint import save_checkpoint
path = sys.argv[1]
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            i = int(line)
            while True:
                i += 1
                save_checkpoint({"model": {"w": torch.full((1_000_000,), float(i))}, "step": i}, path)
                os.write(1, f"{os.getpid()} {i}\n".encode())
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    os.write(1, b"killed\n")
"""


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_never_leaves_an_unreadable_newest(tmp_path):
    path = tmp_path / "checkpoints" / "last.pt"
    rng = random.Random(7)
    seen = 0
    forker = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    try:
        for _ in range(12):
            forker.stdin.write(f"{seen}\n")
            forker.stdin.flush()
            saver = int(forker.stdout.readline().split()[0])  # at least one complete save
            time.sleep(rng.uniform(0.0, 0.1))
            os.kill(saver, signal.SIGKILL)
            while forker.stdout.readline().strip() != "killed":  # saves it finished before the kill
                assert forker.poll() is None, "the forking process ended"
            state = load_checkpoint(path)  # raises if unreadable
            assert state["model"]["w"][0].item() == state["step"]
            assert state["step"] > seen  # the newest complete save, never an older one
            seen = state["step"]
    finally:
        forker.kill()
        forker.wait()
    # the temporary files of killed saves are swept when the next run takes out_dir over
    CheckpointDir(tmp_path).sweep()
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


# ---------------------------------------------------------------------------------------------------------------
# Files that are not what they claim: one line that says what is wrong, never torch's long message or advice


def _evil(marker) -> object:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return Evil()


def test_a_file_that_would_run_code_is_named_by_its_global_not_torchs_advice(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "epoch": 1, "step": 1, "x": _evil(marker)}, path)
    with pytest.raises(UserError) as e:
        load_checkpoint(path, require=("model",))
    line = e.value.line()
    assert "GLOBAL posix.system" in line and "a safe load refuses to run" in line, line
    assert "weights_only" not in line and "\n" not in line and "\x1b" not in line and not marker.exists()
    model_object = tmp_path / "module.pt"
    torch.save({"model": torch.nn.Linear(2, 2), "epoch": 1, "step": 1}, model_object)
    with pytest.raises(
        UserError, match=r"a pickled model object \(GLOBAL torch\.nn\.modules\.linear\.Linear\)"
    ):
        load_checkpoint(model_object)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty or cut short"),
        (b"garbage" * 10, "not a torch.save file"),
        ("half", "truncated or damaged"),
    ],
)
def test_damaged_files_say_what_is_wrong_in_a_few_words(tmp_path, content, reason):
    path = tmp_path / "c.pt"
    if content == "half":
        whole = save_checkpoint(_state(1), tmp_path / "whole.pt").read_bytes()
        content = whole[: len(whole) // 2]
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    assert reason in e.value.what and len(e.value.line()) < 300, e.value.line()


def test_a_folder_is_called_a_folder_and_the_checkpoint_inside_is_named(tmp_path):
    run = tmp_path / "run"
    CheckpointDir(run).save_epoch(_state(1), 1, is_best=True)
    with pytest.raises(UserError) as e:
        load_checkpoint(run)
    assert "is a folder, not a checkpoint file" in e.value.what and "does not exist" not in e.value.line()
    assert str(run / "checkpoints" / "last.pt") in e.value.hint


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ([1, 2], "is a list, not a state dict"),
        ({}, "is empty"),
        ({"w": torch.ones(1), "b": 3}, "maps 'b' to a int value, not a tensor"),
        ({"model": {"w": torch.ones(1)}, "epoch": 2}, "(a whole checkpoint nested inside?)"),
    ],
)
def test_a_model_entry_that_is_not_a_state_dict_says_what_it_is(tmp_path, model, why):
    path = save_checkpoint({"model": model, "epoch": 1, "step": 1}, tmp_path / "c.pt")
    with pytest.raises(UserError) as e:
        load_checkpoint(path, require=("model", "epoch", "step"))
    assert why in e.value.what, e.value.what


def _fill(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_write_that_fails_names_the_file_not_torchs_unexpected_pos(tmp_path):
    # torch's zip writer reports a failed write as `unexpected pos N vs M`; the OSError under it names the cause
    code = (
        "import sys, torch\n"
        "from ddpkit.checkpoint import save_checkpoint\n"
        "try:\n"
        "    save_checkpoint({'w': torch.zeros(100_000)}, sys.argv[1])\n"
        "except OSError as e:\n"
        "    print(e.errno, e.filename, e.strerror)\n"
    )
    path = tmp_path / "checkpoints" / "last.pt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env=cli_env(),
        preexec_fn=lambda: _fill(64 * 1024),  # `ulimit -f 64`: the file system refuses bigger files (EFBIG)
    )
    assert proc.stdout.split(" ", 2)[:2] == ["27", str(path)], proc.stdout + proc.stderr
    assert not list(path.parent.iterdir())  # the temporary file is gone, nothing half-written stays
