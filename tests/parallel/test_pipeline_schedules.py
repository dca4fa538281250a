"""The zero-bubble pipeline schedules (dist.pp_schedule=interleaved_zb, zbv, dualpipev: torch's
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) on real gloo processes: `ddpkit train`'s
Trainer on the built-in GPT (each schedule) and Llama (zbv) under pp2, and `ddpkit.prepare(pp=2,
pp_schedule="zbv")` on a user's model, end with the weights, validation loss and (prepare) per-step losses of the
one-process run on the same global batch; over two data-parallel replicas (dp2 x pp2: gradients averaged after
the step in place of DDP; zero2: FSDP2 over each stage) too. The placements (looped and V) and the settings these
schedules cannot run with are checked in-process, as the command line's preflight checks them.

Time budget: about 40 s on a quiet 2-core machine (two one-process references in this process, one 2-rank group
of four 6-step runs and a prepare() run, one 4-rank group of two 6-step runs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pipeline_user_model as user
from conftest import GPT_RUN, dist_context, plain, run_group, train_here
from ddpkit.checkpoint import load_checkpoint
from ddpkit.config import load_config
from ddpkit.errors import UserError
from ddpkit.parallel.pipeline.plan import SCHEDULES, check_microbatches, check_pipeline, stage_ids, stage_rank

RUN = [*GPT_RUN, "model.n_layer=4", "train.max_steps=6", "train.clip_grad_norm=0.5"]  # 4 stages of one block
LLAMA = ["model.arch=llama", "model.n_kv_head=2"]
NEW = ("interleaved_zb", "zbv", "dualpipev")


def _assert_close(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(np.asarray(got[k])), ref[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def references(tmp_path_factory, gpt_text) -> dict[str, tuple[dict, float]]:
    """The one-process runs (global batch 8), in this process: {family: (weights, last val_loss)}."""
    out = {}
    for name, extra in (("gpt", []), ("llama", LLAMA)):
        run = tmp_path_factory.mktemp(name) / "run"
        train_here(*RUN, *extra, f"out_dir={run}", f"data.root={gpt_text}", "train.batch_size=8")
        ckpt = load_checkpoint(run / "checkpoints" / "last.pt")
        out[name] = (ckpt["model"], ckpt["metrics_row"]["val_loss"])
    return out


# ------------------------------------------------------------------------------------------ in-process


def test_each_stage_has_one_rank_looped_or_in_a_v():
    assert stage_ids(0, 2, "interleaved_zb") == [0, 2] and stage_ids(1, 2, "interleaved_zb") == [1, 3]
    assert stage_ids(0, 2, "zbv") == [0, 3] and stage_ids(1, 2, "dualpipev") == [1, 2]
    assert stage_ids(1, 4, "zbv") == [1, 6] and stage_ids(3, 4, "zbv") == [3, 4]  # the V turns on rank pp-1
    for schedule in SCHEDULES:
        for pp in (2, 3, 4):
            owners = {s: r for r in range(pp) for s in stage_ids(r, pp, schedule)}
            assert sorted(owners) == list(range(len(owners)))  # every stage once
            assert all(stage_rank(s, pp, schedule) == r for s, r in owners.items())


REFUSED = {
    ("dist.pp_schedule=dualpipev", "dist.pp_microbatches=2"): (
        "dist.pp_schedule=dualpipev needs at least one micro-batch per stage (4), dist.pp_microbatches is 2"
    ),
    ("dist.pp_schedule=interleaved_zb", "dist.pp_microbatches=3", "train.batch_size=6"): (
        "dist.pp_schedule=interleaved_zb needs dist.pp_microbatches a multiple of dist.pp=2, got 3"
    ),
    ("dist.pp_schedule=zbv", "model.n_layer=2"): "model.n_layer=2 blocks cannot be cut into 4 equal pipeline",
    ("dist.pp_schedule=zbv", "dist.strategy=fsdp"): (
        "dist.strategy=fsdp (parameters re-gathered for each backward) with dist.pp_schedule=zbv cannot run "
        "with dist.pp=2"
    ),
    ("dist.pp_schedule=dualpipev", "dist.strategy=hsdp"): "use dist.strategy=zero2",
    ("dist.pp_schedule=interleaved_zb", "model.activation_checkpointing=selective"): (
        "model.activation_checkpointing=selective with dist.pp_schedule=interleaved_zb cannot run with dist.pp=2"
    ),
}


@pytest.mark.parametrize("settings", list(REFUSED))
def test_what_a_zero_bubble_schedule_cannot_run_is_one_line_before_workers_start(settings):
    cfg = load_config(None, [*RUN, "train.batch_size=8", "dist.pp=2", *settings])
    with pytest.raises(UserError) as e:
        check_pipeline(cfg, world_size=4)
    assert REFUSED[settings] in e.value.line()


def test_the_same_checks_hold_for_prepare():
    check_microbatches(4, 2, "dualpipev", where="ddpkit.prepare: ")
    with pytest.raises(UserError, match=r"^ddpkit.prepare: pp_schedule=dualpipev needs at least one micro"):
        check_microbatches(3, 2, "dualpipev", where="ddpkit.prepare: ")
    # zero2 and ddp follow the split backward
    for ok in ("zero2", "ddp", "auto"):
        check_pipeline(load_config(None, [*RUN, "dist.pp=2", "dist.pp_schedule=zbv", f"dist.strategy={ok}"]))


# ----------------------------------------------------------------------------------- real processes


def _train(rank: int, world_size: int, root: str, text: str, runs: dict[str, list[str]]) -> dict:
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    out = {}
    for name, settings in runs.items():
        cfg = load_config(None, [*RUN, f"out_dir={root}/{name}", f"data.root={text}", "dist.pp=2", *settings])
        with Heartbeat(rank, world_size) as heartbeat:
            trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
            row = trainer.fit()
            out[name] = (plain(trainer.strategy.model_state(trainer.wrapped)), row["val_loss"])
    return out


def _pp2(rank: int, world_size: int, root: str, text: str) -> dict:
    runs = {s: ["train.batch_size=8", f"dist.pp_schedule={s}"] for s in NEW}
    runs["llama-zbv"] = [*LLAMA, "train.batch_size=8", "dist.pp_schedule=zbv"]
    out = _train(rank, world_size, root, text, runs)
    out["prepare"] = user.piped(2, "zbv", ("blocks.1", "blocks.2", "blocks.3"))
    return out


@pytest.mark.slow
def test_the_zero_bubble_schedules_equal_one_process(references, gpt_text, tmp_path):
    ranks = run_group(_pp2, 2, str(tmp_path), str(gpt_text), timeout=300)
    for name in (*NEW, "llama-zbv"):
        weights, val_loss = references["llama" if name.startswith("llama") else "gpt"]
        for r in ranks:  # exact evaluation through the V, on every rank
            assert r[name][1] == pytest.approx(val_loss, rel=1e-5), name
        _assert_close(ranks[0][name][0], weights)  # the full state, gathered on rank 0
    ref = user.single()  # a user's model through prepare(pp=2, pp_schedule="zbv"): rank 0 holds both ends
    _assert_close(ranks[0]["prepare"]["state"], {k: torch.from_numpy(v) for k, v in ref["state"].items()})
    for r in ranks:
        assert r["prepare"]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["prepare"]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def _dp2(rank: int, world_size: int, root: str, text: str) -> dict:
    runs = {  # two replicas of 4 samples per step
        "ddp-zbv": ["train.batch_size=4", "dist.pp_schedule=zbv"],
        "zero2-dualpipev": ["train.batch_size=4", "dist.pp_schedule=dualpipev", "dist.strategy=zero2"],
    }
    return _train(rank, world_size, root, text, runs)


@pytest.mark.slow
def test_the_zero_bubble_schedules_over_data_parallel_replicas_equal_one_process(
    references, gpt_text, tmp_path
):
    weights, val_loss = references["gpt"]
    got = run_group(_dp2, 4, str(tmp_path), str(gpt_text), timeout=300)[0]
    for name in ("ddp-zbv", "zero2-dualpipev"):
        _assert_close(got[name][0], weights)
        assert got[name][1] == pytest.approx(val_loss, rel=1e-5)
