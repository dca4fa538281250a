"""checkpoint.format=sharded and checkpoints that reshard: written under one layout and world size, continued
under another to the unbroken run's weights.

Time budget: about 180 s on a quiet 2-core machine (measured: 555 s while the machine ran other suites beside
it): the session's single-process reference (conftest.gpt_reference, shared with the tensor-parallel layouts),
a dp2×tp2 run on 4 processes whose sharded checkpoint is continued three ways, a pp2 run continued two ways, one
fsdp run stopped by SIGTERM and resumed on one process, eval and a one-line refusal; the rest reads and writes
folders in this process.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPT_RUN, assert_user_error, cli_env, gpt_train, run_cli
from ddpkit.checkpoint import TRAIN_KEYS, CheckpointDir, load_checkpoint
from ddpkit.checkpoint.sharded import read_model
from ddpkit.errors import UserError

# The built-in transformer on a small text (conftest.GPT_RUN): the weights after 6 optimizer steps are a function
# of the global batch only, so every layout and world size must reach those of the session's single-process run.


def weights(out: Path) -> dict[str, torch.Tensor]:
    """The full weights of the newest checkpoint in out_dir (a .pt file or a .dcp folder)."""
    newest = CheckpointDir(out).candidates()[0]
    return read_model(newest) if newest.is_dir() else load_checkpoint(newest)["model"]


def assert_close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def unbroken(gpt_reference) -> dict[str, torch.Tensor]:
    """One process, 6 optimizer steps, nothing interrupted (the session's run, conftest.gpt_reference)."""
    return gpt_reference[0]


@pytest.fixture(scope="module")
def tp_at_3(tmp_path_factory, gpt_text) -> Path:
    """4 processes, dp2 x tp2 (fsdp over the data-parallel pairs), stopped at step 3 with a sharded checkpoint."""
    out = tmp_path_factory.mktemp("dp2tp2") / "run"
    gpt_train(out, gpt_text, 4, "dist.tp=2", "checkpoint.format=sharded", "train.max_steps=3", dp=2)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


# (processes, settings): ddp writing sharded folders in turn, zero1 (each rank its optimizer partition), one process
# writing a .pt file
AFTER_TP = {
    "ddp": (2, ["dist.strategy=ddp", "checkpoint.format=sharded"]),
    "zero1": (2, ["dist.strategy=zero1", "checkpoint.format=sharded"]),
    "one_process": (1, []),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(AFTER_TP))
def test_a_dp2_tp2_sharded_checkpoint_continues_on_fewer_processes_to_the_unbroken_weights(
    tp_at_3, unbroken, gpt_text, tmp_path, layout
):
    last = tp_at_3 / "checkpoints" / "last.dcp"
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata",
        *(f"__{r}_0.distcp" for r in range(4)),
        "state.pt",
    ]
    out = _copy(tp_at_3, tmp_path)
    nproc, settings = AFTER_TP[layout]
    proc = gpt_train(out, gpt_text, nproc, *settings, "train.max_steps=6")
    assert f"resumed from {out / 'checkpoints' / 'last.dcp'}" in proc.stdout
    assert_close(weights(out), unbroken)
    newest = CheckpointDir(out).candidates()[0]
    assert load_checkpoint(newest, require=TRAIN_KEYS)["step"] == 6


@pytest.fixture(scope="module")
def pp_at_3(tmp_path_factory, gpt_text) -> Path:
    """2 pipeline stages (pp2), stopped at step 3 with a full checkpoint (.pt, stages merged)."""
    out = tmp_path_factory.mktemp("pp2") / "run"
    gpt_train(out, gpt_text, 2, "dist.pp=2", "train.max_steps=3", dp=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_a_pp2_full_checkpoint_continues_under_ddp_and_on_one_process_to_the_unbroken_weights(
    pp_at_3, unbroken, gpt_text, tmp_path, nproc
):
    out = _copy(pp_at_3, tmp_path)
    proc = gpt_train(out, gpt_text, nproc, "train.max_steps=6")  # dist.strategy=auto: ddp on 2 processes
    assert f"resumed from {out / 'checkpoints' / 'last.pt'}" in proc.stdout
    assert_close(weights(out), unbroken)


@pytest.mark.slow
def test_eval_scores_a_sharded_checkpoint(tp_at_3):
    proc = run_cli("eval", f"checkpoint.path={tp_at_3 / 'checkpoints' / 'last.dcp'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"val_ppl"' in proc.stdout.splitlines()[-1]


def _tp2_saved_then_loaded(rank, world_size, folder):
    """A tiny GPT under tp=2 (strategy single: the replicated parameters' momentum is a Partial DTensor), one SGD
    step, a sharded save, a second step; a fresh model and optimizer loaded from the folder take the same second
    step. (the full weights after the second step of each, the saved weights)"""
    import ddpkit
    from ddpkit.checkpoint import sharded
    from ddpkit.checkpoint.state_dict import model_state
    from ddpkit.models.gpt.model import GPT, lm_loss

    def made():
        torch.manual_seed(0)
        model = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
        return ddpkit.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), tp=2)

    def step(model, opt, seed):
        data = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(seed))
        lm_loss(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    def full(model):
        return {k: v.numpy().copy() for k, v in model_state(model).items()}

    model, opt = made()
    step(model, opt, 1)
    tensors, side = sharded.state_tensors(model, opt)
    sharded.write(Path(folder), tensors, side, rank == 0)
    saved = full(model)
    step(model, opt, 2)
    again, again_opt = made()
    sharded.load(folder, again, again_opt, side)
    step(again, again_opt, 2)
    return full(model), full(again), saved


@pytest.mark.slow
def test_a_tp2_model_with_partial_momentum_saves_sharded_and_continues_from_it(tmp_path):
    from conftest import run_group

    folder = tmp_path / "last.dcp"
    unbroken, resumed, saved = run_group(_tp2_saved_then_loaded, 2, str(folder))[0]
    assert_close(read_model(folder), {k: torch.as_tensor(v) for k, v in saved.items()})
    assert_close(
        {k: torch.as_tensor(v) for k, v in resumed.items()},
        {k: torch.as_tensor(v) for k, v in unbroken.items()},
    )


class Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_metadata_file_that_would_run_code_is_refused_in_one_line(tmp_path):
    _save(CheckpointDir(tmp_path, sharded=True), 1)
    ckpt = tmp_path / "evil.dcp"
    os.rename(tmp_path / "checkpoints" / "last.dcp", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload()))
    proc = run_cli("eval", f"checkpoint.path={ckpt}", cwd=tmp_path)
    assert_user_error(proc, "evil.dcp", "GLOBAL posix.system", "safe load refuses")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_sigterm_writes_a_sharded_checkpoint_exits_3_and_resumes_on_one_process(gpt_text, tmp_path):
    out = tmp_path / "run"
    args = [
        f"out_dir={out}",
        f"data.root={gpt_text}",
        *GPT_RUN,
        "train.batch_size=4",
        "train.epochs=50",  # long enough that the signal comes while it trains
        "dist.strategy=fsdp",
        "checkpoint.format=sharded",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", *args, "--nproc-per-node", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        start_new_session=True,
    )
    log = out / "log.txt"
    for line in proc.stdout:  # the progress lines: SIGTERM once training is under way
        if "step" in line and log.exists() and "[1/50]" in log.read_text():
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    state = load_checkpoint(out / "checkpoints" / "last.dcp", require=TRAIN_KEYS)
    assert state["step"] > 0 and state["consumed"] > 0
    done = gpt_train(
        out, gpt_text, 1, "train.epochs=50", f"train.max_steps={state['step'] + 2}"
    )  # another layout and world size
    assert f"resumed from {out / 'checkpoints' / 'last.dcp'}" in done.stdout
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == state["step"] + 2


# ---------------------------------------------------------------------------------------- in this process


def _save(ckpts: CheckpointDir, epoch: int, consumed: int = 0, best: bool = False) -> None:
    side = {"epoch": epoch, "step": epoch * 10 + consumed, "consumed": consumed}
    ckpts.save_sharded({"model.w": torch.full((3,), float(epoch))}, side, is_main=True, is_best=best)


def test_sharded_folders_follow_the_keep_best_and_last_rules(tmp_path):
    ckpts = CheckpointDir(tmp_path, keep=2, sharded=True)
    for epoch in range(1, 5):
        _save(ckpts, epoch, best=epoch == 2)
    names = sorted(p.name for p in ckpts.dir.iterdir())
    assert names == ["best.dcp", "epoch_0003.dcp", "epoch_0004.dcp", "last.dcp"]
    assert read_model(ckpts.best)["w"].tolist() == [2.0] * 3
    assert read_model(ckpts.last)["w"].tolist() == [4.0] * 3
    _save(ckpts, 4, consumed=8)  # inside epoch 5: last.dcp only
    assert load_checkpoint(ckpts.last)["consumed"] == 8
    assert sorted(p.name for p in ckpts.dir.iterdir()) == names
    assert [p.name for p in ckpts.candidates()] == ["last.dcp", "epoch_0004.dcp", "epoch_0003.dcp"]


def test_a_save_killed_between_its_renames_or_half_way_leaves_the_previous_last(tmp_path):
    ckpts = CheckpointDir(tmp_path, sharded=True)
    _save(ckpts, 1)
    # killed after moving the old last.dcp aside, before the new one took its name
    os.rename(ckpts.last, ckpts.dir / ".last.dcp.prev")
    (ckpts.dir / ".last.dcp.x1y2z3w4.tmp").mkdir()  # ... and a half-written one (as mkdtemp names it)
    path, state = ckpts.newest_complete()
    assert path.name == ".last.dcp.prev" and state["epoch"] == 1
    ckpts.sweep()
    assert sorted(p.name for p in ckpts.dir.iterdir()) == ["epoch_0001.dcp", "last.dcp"]
    assert read_model(ckpts.last)["w"].tolist() == [1.0] * 3


def test_an_unfinished_folder_says_what_is_missing(tmp_path):
    ckpts = CheckpointDir(tmp_path, sharded=True)
    _save(ckpts, 1)
    (ckpts.last / ".metadata").unlink()
    with pytest.raises(UserError, match=r"last.dcp' is unreadable: it has no .metadata \(an unfinished save"):
        load_checkpoint(ckpts.last, require=TRAIN_KEYS)
