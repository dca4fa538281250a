"""ddpkit train / eval end to end on real processes: equivalence, exact evaluation, resume, output files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import assert_user_error, cli_env, run_cli
from ddpkit.metrics import METRIC_KEYS, read_metrics

# Small, deterministic runs: digits, no augmentation, an MLP (no norm/dropout layers), constant lr.
EXACT = [
    "data.augment=false",
    "model.arch=mlp",
    "optim.schedule=constant",
    "optim.ref_batch_size=null",
    "optim.lr=0.05",
]


def weights(out_dir) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def train(out_dir, *args, timeout=300):
    proc = run_cli("train", f"out_dir={out_dir}", *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_world_size_and_accumulation_equivalence(tmp_path):
    # 2 processes x batch B == 1 process x 2B == 2 processes x B/2 with 2 accumulation steps.
    steps = ["train.max_steps=12", "train.epochs=1"]
    train(tmp_path / "one", *EXACT, *steps, "train.batch_size=32")
    train(tmp_path / "two", *EXACT, *steps, "train.batch_size=16", "--nproc-per-node", "2")
    train(
        tmp_path / "acc",
        *EXACT,
        *steps,
        "train.batch_size=8",
        "train.grad_accum_steps=2",
        "--nproc-per-node",
        "2",
    )
    one, two, acc = (weights(tmp_path / n) for n in ("one", "two", "acc"))
    assert_same_weights(one, two)
    assert_same_weights(one, acc)
    init = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)
    assert init["step"] == 12
    rows = [read_metrics(tmp_path / n)[-1] for n in ("one", "two", "acc")]
    assert [r["global_batch_size"] for r in rows] == [32, 32, 32]
    assert [r["world_size"] for r in rows] == [1, 2, 2]
    assert rows[0]["train_loss"] == pytest.approx(rows[1]["train_loss"], rel=1e-4)


@pytest.mark.slow
def test_exact_evaluation_on_1_to_4_processes(tmp_path):
    run = tmp_path / "run"
    train(run, *EXACT, "train.epochs=1")
    ckpt = run / "checkpoints" / "best.pt"
    results = []
    for n in (1, 2, 3, 4):
        launch = ["--nproc-per-node", str(n)] if n > 1 else []
        proc = run_cli("eval", f"checkpoint.path={ckpt}", *launch, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {r["val_samples"] for r in results} == {359}  # 359 is prime: no world size divides it
    for r in results[1:]:
        assert r["val_acc1"] == pytest.approx(results[0]["val_acc1"], abs=1e-9)
        assert r["val_loss"] == pytest.approx(results[0]["val_loss"], rel=1e-5)
    assert results[0]["val_acc1"] == pytest.approx(read_metrics(run)[-1]["val_acc1"], abs=1e-9)


def run_until_epoch(cmd: list[str], out_dir, epoch: int, timeout: float = 300) -> None:
    """Start `cmd`, SIGKILL its whole process group once metrics.jsonl holds `epoch` lines."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(), start_new_session=True
    )
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if len(read_metrics(out_dir)) >= epoch:
                break
            if proc.poll() is not None:
                raise AssertionError(f"run ended early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        else:
            raise AssertionError("run did not reach the epoch in time")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_resume_after_kill_equals_unbroken_run(tmp_path):
    # With augmentation on: the per-epoch streams depend only on (seed, rank, epoch).
    args = ["model.arch=mlp", "train.epochs=4", "--nproc-per-node", "2"]
    train(tmp_path / "unbroken", *args)
    broken = tmp_path / "broken"
    cmd = [sys.executable, "-m", "ddpkit", "train", f"out_dir={broken}", *args]
    run_until_epoch(cmd, broken, 2)
    assert len(read_metrics(broken)) < 4
    proc = train(broken, *args)
    assert "resumed from" in proc.stdout
    a, b = read_metrics(tmp_path / "unbroken"), read_metrics(broken)
    assert [r["epoch"] for r in b] == [1, 2, 3, 4]  # each epoch exactly once
    for ra, rb in zip(a, b, strict=True):
        for key in ("train_loss", "train_acc1", "val_loss", "val_acc1", "lr"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(weights(tmp_path / "unbroken"), weights(broken))


@pytest.mark.slow
def test_finished_run_is_not_repeated(tmp_path):
    run = tmp_path / "run"
    train(run, *EXACT, "train.epochs=1")
    before = (run / "metrics.jsonl").read_text()
    proc = train(run, *EXACT, "train.epochs=1")
    assert "nothing to train" in proc.stdout and "final val_acc1" in proc.stdout
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_run_directory_contract(tmp_path):
    run = tmp_path / "run"
    proc = train(run, "train.epochs=3", "checkpoint.keep=2", "model.arch=mlp", "--nproc-per-node", "2")
    assert "final val_acc1" in proc.stdout
    assert (run / "config.yaml").is_file() and (run / "log.txt").read_text().count("epoch 3/3") == 1
    rows = read_metrics(run)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(METRIC_KEYS) <= set(r)
        assert 0 <= r["train_acc1"] <= 1 and 0 <= r["val_acc1"] <= 1 and 0 <= r["val_acc5"] <= 1
        assert r["val_samples"] == 359 and r["world_size"] == 2 and r["global_batch_size"] == 64
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["best.pt", "epoch_0002.pt", "epoch_0003.pt", "last.pt"]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "config"} <= set(state)
    assert state["epoch"] == 3 and state["step"] == 3 * (1438 // 64)
    assert not any(k.startswith("module.") for k in state["model"])  # the unwrapped model's state_dict
    # only rank 0 printed: one summary line, not two
    assert proc.stdout.count("final val_acc1") == 1


def test_non_tty_progress_lines_look_like_the_tutorials(tmp_path):
    proc = train(tmp_path / "run", *EXACT, "train.epochs=1", "train.log_every=10")
    assert "== step: [10/44] [1/1] | loss: " in proc.stdout and "| acc: " in proc.stdout


def test_eval_errors(tmp_path):
    assert_user_error(run_cli("eval"), "checkpoint.path")
    assert_user_error(run_cli("eval", f"checkpoint.path={tmp_path / 'missing.pt'}"), "does not exist")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    assert_user_error(run_cli("eval", f"checkpoint.path={bad}"), "unreadable")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert_user_error(run_cli("eval", f"checkpoint.path={empty}"), "unreadable")


def test_eval_uses_the_checkpoints_model(tmp_path):
    run = tmp_path / "run"
    train(run, *EXACT, "train.epochs=1")
    proc = run_cli("eval", f"checkpoint.path={run / 'checkpoints' / 'last.pt'}")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"val_loss", "val_acc1", "val_acc5", "val_samples"} <= set(result)
    mismatch = run_cli("eval", f"checkpoint.path={run / 'checkpoints' / 'last.pt'}", "model.arch=cnn")
    assert_user_error(mismatch, "does not fit")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_trains_and_checkpoints_the_scaler(tmp_path, amp):
    # CPU autocast in the given dtype; fp16 also runs a GradScaler whose state goes into the checkpoint and
    # comes back on resume (a scaler that restarts at 65536 would skip steps after every resume).
    out = tmp_path / amp
    train(out, *EXACT, "train.epochs=1", "train.max_steps=6", "train.batch_size=32", f"train.amp={amp}")
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    rows = read_metrics(out)
    assert len(rows) == 1 and rows[0]["train_loss"] == rows[0]["train_loss"]  # finite, not NaN
    if amp == "bf16":
        assert not state["scaler"]  # no scaler without fp16
        return
    scale = state["scaler"]["scale"]
    assert scale > 0
    proc = train(out, *EXACT, "train.epochs=2", "train.batch_size=32", "train.amp=fp16")
    assert "resumed from" in proc.stdout + proc.stderr
    again = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["scaler"]
    assert again["scale"] > 0 and again["_growth_tracker"] >= state["scaler"]["_growth_tracker"]


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(tmp_path):
    # torch.compile (inductor on the CPU): same weights as eager after a few steps, and a checkpoint whose
    # keys carry no `_orig_mod.` prefix, so eval and resume load it into a plain model.
    steps = ["train.epochs=1", "train.max_steps=4", "train.batch_size=32"]
    train(tmp_path / "eager", *EXACT, *steps)
    train(tmp_path / "compiled", *EXACT, *steps, "model.compile=true", timeout=600)
    eager, compiled = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert not any(k.startswith("_orig_mod.") for k in compiled)
    assert_same_weights(eager, compiled, atol=1e-4)
