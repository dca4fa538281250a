"""ddpkit train / eval end to end on real processes: equivalence, exact evaluation, resume, output files."""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import (
    REPO,
    assert_user_error,
    cli_env,
    dist_context,
    plain,
    run_cli,
    run_clis,
    run_group,
    train_here,
)
from ddpkit.config import Config, load_config
from ddpkit.train.health import Heartbeat
from ddpkit.train.metrics import METRIC_KEYS, read_metrics
from ddpkit.train.trainer import Trainer

# Small, deterministic runs: digits, no augmentation, an MLP (no norm/dropout layers), constant lr.
EXACT = [
    "data.augment=false",
    "model.arch=mlp",
    "train.batch_size=32",  # the step counts below are of 32 per process
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
    runs = {
        "two": ["train.batch_size=16", "--nproc-per-node", "2"],
        "acc": ["train.batch_size=8", "train.grad_accum_steps=2", "--nproc-per-node", "2"],
    }
    with ThreadPoolExecutor(max_workers=1) as pool:  # the launches, while this process makes the reference
        procs = pool.submit(
            run_clis, *(["train", f"out_dir={tmp_path / n}", *EXACT, *steps, *a] for n, a in runs.items())
        )
        train_here(f"out_dir={tmp_path / 'one'}", *EXACT, *steps, "train.batch_size=32")
        for proc in procs.result():
            assert proc.returncode == 0, proc.stderr[-3000:]
    one, two, acc = (weights(tmp_path / n) for n in ("one", "two", "acc"))
    assert_same_weights(one, two)
    assert_same_weights(one, acc)
    init = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)
    assert init["step"] == 12
    rows = [read_metrics(tmp_path / n)[-1] for n in ("one", "two", "acc")]
    assert [r["global_batch_size"] for r in rows] == [32, 32, 32]
    assert [r["world_size"] for r in rows] == [1, 2, 2]
    assert rows[0]["train_loss"] == pytest.approx(rows[1]["train_loss"], rel=1e-4)


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> tuple[Path, str]:
    """One epoch of EXACT on one process (shared by the tests that read it): its out_dir and its stdout."""
    run = tmp_path_factory.mktemp("one_epoch") / "run"
    return run, train(run, *EXACT, "train.epochs=1", "train.log_every=10").stdout


@pytest.mark.slow
def test_exact_evaluation_on_1_to_4_processes(one_epoch):
    run, ckpt = one_epoch[0], one_epoch[0] / "checkpoints" / "best.pt"
    results = []
    launches = (["--nproc-per-node", str(n)] if n > 1 else [] for n in (1, 2, 3, 4))
    for proc in run_clis(*(["eval", f"checkpoint.path={ckpt}", *launch] for launch in launches)):
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
    broken = tmp_path / "broken"
    cmd = [sys.executable, "-m", "ddpkit", "train", f"out_dir={broken}", *args]
    with ThreadPoolExecutor(max_workers=1) as pool:  # the unbroken run beside the one that is killed
        unbroken = pool.submit(train, tmp_path / "unbroken", *args)
        run_until_epoch(cmd, broken, 2)
        unbroken.result()
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
def test_finished_run_is_not_repeated(one_epoch, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_epoch[0], run)  # the finished run, run again with the same settings
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
        assert r["val_samples"] == 359 and r["world_size"] == 2 and r["global_batch_size"] == 128
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["best.pt", "epoch_0002.pt", "epoch_0003.pt", "last.pt"]
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "epoch", "step", "config"} <= set(state)
    assert state["epoch"] == 3 and state["step"] == 3 * (1438 // 128)  # 2 processes x 64
    assert not any(k.startswith("module.") for k in state["model"])  # the unwrapped model's state_dict
    # only rank 0 printed: one summary line, not two
    assert proc.stdout.count("final val_acc1") == 1


def test_non_tty_progress_lines_look_like_the_tutorials(one_epoch):
    _, stdout = one_epoch  # train.log_every=10
    assert "== step: [10/44] [1/1] | loss: " in stdout and "| acc: " in stdout


@pytest.mark.slow
def test_eval_errors(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint at all")
    (tmp_path / "empty.pt").write_bytes(b"")
    cases = {
        "": "checkpoint.path",
        "missing.pt": "does not exist",
        "bad.pt": "unreadable",
        "empty.pt": "unreadable",
    }
    procs = run_clis(*(["eval", f"checkpoint.path={tmp_path / n}"] if n else ["eval"] for n in cases))
    for proc, fragment in zip(procs, cases.values(), strict=True):
        assert_user_error(proc, fragment)


@pytest.mark.slow
def test_eval_uses_the_checkpoints_model(one_epoch):
    proc = run_cli("eval", f"checkpoint.path={one_epoch[0] / 'checkpoints' / 'last.pt'}")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"val_loss", "val_acc1", "val_acc5", "val_samples"} <= set(result)
    mismatch = run_cli(
        "eval", f"checkpoint.path={one_epoch[0] / 'checkpoints' / 'last.pt'}", "model.arch=cnn"
    )
    assert_user_error(mismatch, "does not fit")


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.slow
def test_amp_trains_and_checkpoints_the_scaler(tmp_path, amp):
    # CPU autocast in the given dtype; fp16 also runs a GradScaler whose state goes into the checkpoint and
    # comes back on resume (a scaler that restarts at 65536 would skip steps after every resume).
    out = tmp_path / amp
    train(out, *EXACT, "train.epochs=1", "train.max_steps=6", "train.batch_size=32", f"train.amp={amp}")
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    rows = read_metrics(out)
    assert len(rows) == 1 and math.isfinite(rows[0]["train_loss"])  # neither NaN nor inf
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
    with ThreadPoolExecutor(max_workers=1) as pool:  # compiled in its own process, eager in this one
        compiled = pool.submit(
            train, tmp_path / "compiled", *EXACT, *steps, "model.compile=true", timeout=600
        )
        train_here(f"out_dir={tmp_path / 'eager'}", *EXACT, *steps)
        compiled.result()
    eager, compiled = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert not any(k.startswith("_orig_mod.") for k in compiled)
    assert_same_weights(eager, compiled, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# The Trainer in-process, on real one- and two-process gloo groups (conftest.run_group)


def tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def small_config(out_dir, *overrides: str) -> Config:
    """The EXACT recipe (digits, an MLP, constant lr) in out_dir, with KEY=VALUE overrides."""
    return load_config(None, [f"out_dir={out_dir}", *EXACT, *overrides])


def _train_steps(rank: int, world_size: int, out_dir: str, batch_size: int, accum: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    cfg = small_config(out_dir, f"train.batch_size={batch_size}", f"train.grad_accum_steps={accum}")
    with Heartbeat(rank, world_size) as heartbeat:
        trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
        syncs: list[int] = []
        if world_size > 1:  # count DDP's gradient all-reduces (one per bucket per synced backward)

            def counting(state, bucket):
                syncs.append(bucket.index())
                return allreduce_hook(None, bucket)

            trainer.wrapped.register_comm_hook(None, counting)
        trainer.state.begin_epoch(1)
        micro_batches = iter(trainer.train_loader)
        for _ in range(3):
            trainer.train_step(itertools.islice(micro_batches, accum))
        micro_batches.close()
        return {
            "weights": plain(trainer.strategy.model_state(trainer.wrapped)),
            "step": trainer.state.step,
            "consumed": trainer.state.consumed,
            "syncs": syncs,
            "buckets": len(set(syncs)),
        }


@pytest.mark.slow
def test_train_step_with_accumulation_on_two_ranks_equals_one_rank_with_the_global_batch(tmp_path):
    (one,) = run_group(_train_steps, 1, str(tmp_path / "one"), 32, 1)
    two = run_group(_train_steps, 2, str(tmp_path / "two"), 8, 2)
    assert one["step"] == two[0]["step"] == 3 and one["consumed"] == two[1]["consumed"] == 3 * 32
    assert_same_weights(tensors(one["weights"]), tensors(two[0]["weights"]))
    assert_same_weights(tensors(two[0]["weights"]), tensors(two[1]["weights"]), atol=0)
    # gradients are all-reduced once per optimizer step (no_sync on the first micro-batch), not per micro-batch
    assert len(two[0]["syncs"]) == 3 * two[0]["buckets"]


def _resume_mid_epoch(rank: int, world_size: int, out_dir: str) -> dict:
    cfg = small_config(out_dir, "data.augment=true", "train.batch_size=16")  # augmentation: the RNG matters
    ctx = dist_context(rank, world_size)
    with Heartbeat(rank, world_size) as heartbeat:
        first = Trainer(cfg, ctx, heartbeat)
        first.state.begin_epoch(1)
        micro_batches = iter(first.train_loader)
        for _ in range(4):
            first.train_step([next(micro_batches)])
        first.checkpoint()  # mid-epoch: last.pt only
        saved = (first.state.epoch, first.state.step, first.state.consumed)
        for _ in range(3):
            first.train_step([next(micro_batches)])
        micro_batches.close()

        again = Trainer(cfg, ctx, heartbeat)  # the same command run again
        again.resume()
        resumed = (again.state.epoch, again.state.step, again.state.consumed)
        again.state.begin_epoch(1)
        micro_batches = iter(again.train_loader)
        for _ in range(3):
            again.train_step([next(micro_batches)])
        micro_batches.close()
        return {
            "saved": saved,
            "resumed": resumed,
            "first": plain(first.strategy.model_state(first.wrapped)),
            "again": plain(again.strategy.model_state(again.wrapped)),
            "means": (first.state.epoch_means(), again.state.epoch_means()),
            "files": sorted(p.name for p in (Path(out_dir) / "checkpoints").iterdir()),
        }


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_resumes_to_the_same_weights_on_two_ranks(tmp_path):
    rank0, rank1 = run_group(_resume_mid_epoch, 2, str(tmp_path / "run"))
    assert rank0["saved"] == rank0["resumed"] == rank1["resumed"] == (0, 4, 4 * 32)
    assert rank0["files"] == ["last.pt"]  # inside an epoch: no epoch file, no best.pt
    assert_same_weights(tensors(rank0["first"]), tensors(rank0["again"]), atol=0)
    (loss, acc, n), (loss2, acc2, n2) = rank0["means"]
    assert n == n2 == 7 * 32 and acc == acc2 and loss == pytest.approx(loss2, rel=1e-12)


def _max_steps_runs(rank: int, world_size: int, root: str) -> dict:
    ctx = dist_context(rank, world_size)
    common = ("train.epochs=2", "train.batch_size=16")
    out = {}
    with Heartbeat(rank, world_size) as heartbeat:
        Trainer(small_config(f"{root}/broken", *common, "train.max_steps=5"), ctx, heartbeat).fit()
        stopped = torch.load(f"{root}/broken/checkpoints/last.pt", weights_only=True)
        out["stopped"] = {k: stopped[k] for k in ("epoch", "step", "consumed", "metrics_row")}
        out["rows_before"] = read_metrics(f"{root}/broken")
        Trainer(small_config(f"{root}/broken", *common, "train.max_steps=5"), ctx, heartbeat).fit()  # again
        out["rows_again"] = read_metrics(f"{root}/broken")
        Trainer(small_config(f"{root}/broken", *common, "train.max_steps=50"), ctx, heartbeat).fit()
        Trainer(small_config(f"{root}/unbroken", *common, "train.max_steps=50"), ctx, heartbeat).fit()
    return out


@pytest.mark.slow
def test_max_steps_inside_an_epoch_checkpoints_mid_epoch_and_a_larger_max_steps_continues_it(tmp_path):
    root = tmp_path / "runs"
    rank0, _ = run_group(_max_steps_runs, 2, str(root))
    stopped = rank0["stopped"]  # 5 of epoch 1's 44 optimizer steps: epoch 1 is not finished
    assert (stopped["epoch"], stopped["step"], stopped["consumed"]) == (0, 5, 5 * 32)
    assert stopped["metrics_row"]["epoch"] == 1 and stopped["metrics_row"]["step"] == 5
    # a finished run (as today): evaluated, one metrics line; the same command again changes nothing
    assert [r["epoch"] for r in rank0["rows_before"]] == [1] and rank0["rows_before"][0][
        "val_acc1"
    ] is not None
    assert rank0["rows_again"] == rank0["rows_before"]
    log = (root / "broken" / "log.txt").read_text()
    assert "nothing to train" in log
    assert "(epoch 0, 160 samples into epoch 1, step 5)" in log  # the larger max_steps continues epoch 1
    broken, unbroken = read_metrics(root / "broken"), read_metrics(root / "unbroken")
    assert [r["epoch"] for r in broken] == [r["epoch"] for r in unbroken] == [1, 2]  # epoch 1 once, whole
    for a, b in zip(broken, unbroken, strict=True):
        assert a["step"] == b["step"]
        for key in ("train_loss", "train_acc1", "val_loss", "val_acc1", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    assert_same_weights(weights(root / "broken"), weights(root / "unbroken"), atol=1e-6)
    # the resumed part's throughput counts only the samples trained after the resume (39 of 44 steps)
    first = broken[0]
    assert first["train_images_per_s"] * first["epoch_time_s"] == pytest.approx(39 * 32, rel=0.02)


def test_an_epoch_with_less_than_one_step_left_after_a_resume_ends_instead_of_repeating(tmp_path):
    # A checkpoint 1400 samples into the epoch, resumed where one optimizer step takes 64: the 38 left make no
    # step, so the epoch is over (before, the loop trained nothing, never finished the epoch, and fit() looped).
    trainer = Trainer(small_config(tmp_path / "run", "train.batch_size=64"), dist_context(0, 1))
    trainer.state.load_state_dict({"epoch": 0, "step": 40, "consumed": 1400})
    loss, acc, samples = trainer.train_epoch(1)
    assert (trainer.state.epoch, trainer.state.step, trainer.state.consumed, samples) == (1, 40, 0, 0)
    trainer.log.close()


def _one_step_nan_first(rank: int, world_size: int, out_dir: str) -> dict:
    cfg = small_config(out_dir, "train.grad_accum_steps=2", "train.nonfinite=skip", "train.batch_size=4")
    trainer = Trainer(cfg, dist_context(rank, world_size))
    Path(out_dir).mkdir(parents=True)
    trainer.log.open()  # fit() opens log.txt once the run owns out_dir; this test drives the steps itself
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    x, y = next(iter(trainer.train_loader))
    trainer.train_step([(torch.full_like(x, math.nan), y), (x, y)])  # only the first micro-batch is bad
    skipped = all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    trainer.train_step([(x, y), (x, y)])
    moved = not all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    trainer.log.close()
    trainer.heartbeat.close()
    return {"skipped": skipped, "moved": moved, "step": trainer.state.step}


@pytest.mark.slow
def test_skip_drops_a_step_whose_earlier_micro_batch_was_nonfinite(tmp_path):
    (result,) = run_group(_one_step_nan_first, 1, str(tmp_path / "run"))
    assert result == {"skipped": True, "moved": True, "step": 2}
    assert "non-finite loss at step 1; step skipped" in (tmp_path / "run" / "log.txt").read_text()


def _pretrained_lines(rank: int, world_size: int, out_dir: str, weights_file: str) -> str:
    console = io.StringIO()
    sys.stdout = console  # rank 0's RunLog prints here
    cfg = small_config(
        out_dir, f"model.pretrained={weights_file}", "train.max_steps=1", "report.curves=false"
    )
    Trainer(cfg, dist_context(rank, world_size)).fit()  # log.txt is written once the run has out_dir
    return console.getvalue()


@pytest.mark.slow
def test_rank_0_prints_and_logs_what_the_pretrained_weights_filled_in(tmp_path):
    from ddpkit.models import build_mlp

    weights_file = tmp_path / "w.pt"
    torch.save(build_mlp(10, 1, 8).state_dict(), weights_file)
    rank0, rank1 = run_group(_pretrained_lines, 2, str(tmp_path / "run"), str(weights_file))
    line = f"loaded 6/6 tensors from {weights_file}"
    assert rank0.count(line) == 1 and rank1 == ""
    assert (tmp_path / "run" / "log.txt").read_text().count(line) == 1


# ---------------------------------------------------------------------------------------------------------------
# docs/run-dir.md describes every file, checkpoint key and metrics field a run writes


def _doc_table(section: str) -> set[str]:
    text = (REPO / "docs" / "run-dir.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \|", body, flags=re.MULTILINE))


def _short_run(rank: int, world_size: int, out_dir: str) -> None:
    cfg = small_config(out_dir, "train.epochs=2", "train.max_steps=50", "checkpoint.every_steps=20")
    Trainer(cfg, dist_context(rank, world_size)).fit()


@pytest.mark.slow
def test_run_dir_doc_names_every_file_checkpoint_key_and_metrics_field_written(tmp_path):
    run = tmp_path / "run"
    run_group(_short_run, 1, str(run))  # epoch 1 whole, epoch 2 stopped inside by train.max_steps
    files = {p.name + "/" if p.is_dir() else p.name for p in run.iterdir()} - {"checkpoints/"}
    files |= {"checkpoints/" + re.sub(r"\d{4}", "NNNN", p.name) for p in (run / "checkpoints").iterdir()}
    # previous/: only after checkpoint.overwrite moved a run aside; tokenizer.json: a language model's only
    assert files == _doc_table("Files") - {"previous/", "tokenizer.json"}
    keys = set()
    for name in ("last.pt", "best.pt", "epoch_0001.pt"):
        state = torch.load(run / "checkpoints" / name, weights_only=True)
        keys |= set(state)
        assert state["metrics_row"] is not None
    # comm_hook: only with dist.grad_compression=powersgd (tests/parallel/test_compression.py); tokenizer: a
    # language model's only (tests/commands/test_generate.py)
    optional = {"comm_hook", "tokenizer"}
    assert keys == _doc_table("Checkpoint format") - optional
    fields = {k for row in read_metrics(run) for k in row}
    only_resumed = {"resumed_after"}  # in the first line of a resumed run only (tests/test_report.py's runs)
    assert fields == _doc_table("metrics.jsonl") - only_resumed
    assert set(METRIC_KEYS) <= fields
