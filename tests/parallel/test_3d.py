"""Sharded data parallel next to tensor and pipeline parallelism, HSDP, and gradient accumulation under a pipeline,
each ending with the weights of the single-process run (the GPT of conftest.GPT_RUN, 6 SGD steps, global batch 8,
gradients clipped to a norm the steps exceed: the norm over every stage and shard is the one-process norm) on real
gloo processes.

- 8 processes (oversubscribed): dist.tp=2 x dist.pp=2 x dp=2 with dist.strategy=fsdp (FSDP2 over the dp dim of each
  tensor-parallel stage), train.grad_accum_steps=2, a sharded checkpoint at step 3; continued on 1 process to step
  6, it reaches the unbroken run's weights (the 3-D steps, the accumulation and the resharding checkpoint together);
  and dist.strategy=zero2 on the same layout, 6 steps.
- 4 processes (the reused rank pool, the Trainer in-process): HSDP 2 x 2 (dist.strategy=hsdp dist.dp_shard=2),
  and zero2 over the two data-parallel replicas of a 2-stage pipeline with gradient accumulation.
- in-process: the coordinates, the defaults and the one-line refusals.

Time budget: about 110 s on a quiet 2-core machine (one 8-process run, one 1-process resume, one 4-rank group of
two 6-step runs, a one-process reference in this process). Measured at load average 13-26: 82 s (the 4-rank
group), 73 s (8 processes and the resume), 26 s (the references, the unclipped one shared with other modules).
The one-line refusals are checked in-process (the command line's preflight calls the same check_config).
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_RUN, dist_context, gpt_train, plain, run_group, train_here
from ddpkit.checkpoint import CheckpointDir, load_checkpoint
from ddpkit.checkpoint.sharded import read_model
from ddpkit.config import load_config
from ddpkit.errors import UserError
from ddpkit.parallel.mesh import Layout, layout_of, shard_degree
from ddpkit.parallel.plan import check_config


def _weights(out) -> dict[str, torch.Tensor]:
    newest = CheckpointDir(out).candidates()[0]
    return read_model(newest) if newest.is_dir() else load_checkpoint(newest)["model"]


CLIP = ["train.clip_grad_norm=0.2"]


@pytest.fixture(scope="module")
def reference(gpt_reference, gpt_text, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The one-process run with CLIP, in this process; its weights differ from the unclipped session run's."""
    out = tmp_path_factory.mktemp("clipped") / "run"
    train_here(
        *GPT_RUN, f"out_dir={out}", f"data.root={gpt_text}", "train.batch_size=8", "train.max_steps=6", *CLIP
    )
    weights = _weights(out)
    with pytest.raises(AssertionError):  # the clip changed the steps
        _assert_close(weights, gpt_reference[0])
    return weights


def _assert_close(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(got[k]), ref[k], rtol=1e-4, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------------- in-process checks


def test_hsdp_coordinates_split_the_data_parallel_dim_into_replicas_of_sharding_groups():
    layout = layout_of(8, tp=2, dp_shard=2)  # dp=4: 2 replicas x 2 shards, tensor peers next to each other
    assert [layout.coords(r) for r in (0, 2, 5, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0, "dp_replicate": 0, "dp_shard": 0, "ep": 0, "edp": 0},
        {"pp": 0, "dp": 1, "tp": 0, "dp_replicate": 0, "dp_shard": 1, "ep": 0, "edp": 1},
        {"pp": 0, "dp": 2, "tp": 1, "dp_replicate": 1, "dp_shard": 0, "ep": 0, "edp": 2},
        {"pp": 0, "dp": 3, "tp": 1, "dp_replicate": 1, "dp_shard": 1, "ep": 0, "edp": 3},
    ]
    assert layout.describe(7) == "dp_replicate=1 dp_shard=1 dp=3 tp=1 pp=0"  # what `ddpkit info` prints
    assert Layout(dp=2, tp=2, pp=2).describe(5) == "dp_replicate=0 dp_shard=0 dp=0 tp=1 pp=1"
    # the default sharding group: one node's data-parallel ranks (processes per node over tp), all dp at most
    assert shard_degree(None, dp=8, tp=1, per_node=4) == 4
    assert shard_degree(None, dp=4, tp=2, per_node=4) == 2
    assert shard_degree(None, dp=2, tp=1, per_node=8) == 2
    assert shard_degree(3, dp=6, tp=1, per_node=2) == 3


def _cfg(*overrides: str):
    return load_config(None, [*GPT_RUN, "train.batch_size=2", *overrides])


def test_sharded_data_parallel_is_accepted_over_tensor_and_pipeline_parallel_stages():
    for name in ("fsdp", "zero2", "hsdp"):
        layout = check_config(_cfg("dist.tp=2", "dist.pp=2", f"dist.strategy={name}"), 8, per_node=8)
        assert (layout.dp, layout.tp, layout.pp) == (2, 2, 2)
    # hsdp's sharding group defaults to the data-parallel ranks of one node
    assert check_config(_cfg("dist.strategy=hsdp"), 8, per_node=4).dp_shard == 4
    assert check_config(_cfg("dist.strategy=hsdp", "dist.dp_shard=2"), 8, per_node=8).dp_shard == 2


REFUSED = {
    (
        "dist.tp=2",
        "dist.pp=2",
        "dist.strategy=ddp",
    ): "dist.strategy=ddp cannot run over tensor-parallel (DTensor)",
    (
        "dist.pp=2",
        "dist.strategy=zero1",
    ): "dist.strategy=zero1 cannot run over the data-parallel ranks of a pipeline",
    ("dist.dp_shard=2",): "dist.dp_shard=2 sets HSDP's sharding group, but dist.strategy is auto",
    ("dist.strategy=hsdp", "dist.dp_shard=3"): "dist.dp_shard=3 does not divide the 8 data-parallel rank(s)",
}


@pytest.mark.parametrize("settings", list(REFUSED))
def test_a_layout_that_cannot_run_is_one_line_before_workers_start(settings):
    with pytest.raises(UserError) as e:
        check_config(_cfg(*settings), 8, per_node=8)
    assert REFUSED[settings] in e.value.line()


# ----------------------------------------------------------------------------- 8 processes: dp x tp x pp


@pytest.mark.slow
def test_fsdp_over_tp2_pp2_with_accumulation_writes_a_sharded_checkpoint_that_one_process_continues(
    reference, gpt_text, tmp_path
):
    out = tmp_path / "run"
    # global batch 8 = 2 per rank x dp 2 x 2 accumulated steps (gpt_train's `dp` only sets the per-rank batch)
    three_d = gpt_train(
        out,
        gpt_text,
        8,
        "dist.tp=2",
        "dist.pp=2",
        "dist.strategy=fsdp",
        "dist.pp_microbatches=2",
        "train.grad_accum_steps=2",
        "checkpoint.format=sharded",
        "train.max_steps=3",
        *CLIP,
        "--oversubscribe",
        dp=4,
    )
    assert "strategy fsdp, pipeline 2 stages (1f1b) over dp=2 x tp=2 x pp=2, global batch 8 (2 x 2 x 2)" in (
        three_d.stdout
    )
    last = out / "checkpoints" / "last.dcp"
    assert sorted(p.name for p in last.iterdir() if p.suffix == ".distcp") == [
        f"__{r}_0.distcp" for r in range(8)
    ]
    resumed = gpt_train(
        out, gpt_text, 1, "train.max_steps=6", *CLIP
    )  # every rank's shards read into one process
    assert f"resumed from {last}" in resumed.stdout
    _assert_close(_weights(out), reference)


@pytest.mark.slow
def test_zero2_over_tp2_pp2_on_8_processes_equals_one_process(reference, gpt_text, tmp_path):
    # ZeRO-2 (FSDP2 without resharding after forward) over the dp dim of each tensor-parallel pipeline stage
    three_d = gpt_train(
        tmp_path / "run", gpt_text, 8, "dist.tp=2", "dist.pp=2", "dist.strategy=zero2", "dist.pp_microbatches=2",
        "train.max_steps=6", *CLIP, "--oversubscribe", dp=2,
    )  # fmt: skip
    assert (
        "strategy zero2, pipeline 2 stages (1f1b) over dp=2 x tp=2 x pp=2, global batch 8" in three_d.stdout
    )
    _assert_close(_weights(tmp_path / "run"), reference)


# ------------------------------------------------------------------- 4 ranks: HSDP 2 x 2, zero2 over a pipeline

FOUR = {
    # 2 replicas of 2-rank sharding groups; 2 samples per rank
    "hsdp": ("dist.strategy=hsdp", "dist.dp_shard=2", "train.batch_size=2"),
    # 2 replicas of a 2-stage pipeline, each stage FSDP2 without resharding after forward; 2 samples per rank
    # and step, 2 steps accumulated
    "zero2-pp2-accum": (
        "dist.strategy=zero2",
        "dist.pp=2",
        "dist.pp_microbatches=2",
        "train.grad_accum_steps=2",
        "train.batch_size=2",
    ),
}


def _four(rank: int, world_size: int, root: str, text: str) -> dict:
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    weights = {}
    for name, settings in FOUR.items():
        run = [f"out_dir={root}/{name}", f"data.root={text}", "train.max_steps=6", *CLIP, *settings]
        cfg = load_config(None, [*GPT_RUN, *run])
        with Heartbeat(rank, world_size) as heartbeat:
            trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
            trainer.fit()
            weights[name] = plain(trainer.strategy.model_state(trainer.wrapped))
    return weights


@pytest.mark.slow
def test_hsdp_2x2_and_zero2_over_a_pipeline_with_accumulation_equal_one_process(
    reference, gpt_text, tmp_path
):
    weights = run_group(_four, 4, str(tmp_path), str(gpt_text), timeout=300)[0]  # full weights on rank 0
    for name in FOUR:
        _assert_close(weights[name], reference)
