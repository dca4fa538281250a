"""What a training step of `ddpkit train` costs beyond the model's own work, counted on real runs: between two
log points no blocking host read and no collective but the strategy's own; loader workers start once a run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import GPT_RUN, GPT_TEXT, dist_context, run_group
from ddpkit.config import load_config
from ddpkit.train.trainer import Trainer

SMALL = ["data.augment=false", "model.arch=mlp", "optim.schedule=constant", "optim.ref_batch_size=null"]

# What makes the host wait for the device (on a GPU every one of them ends the overlap of host and device).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# A memory-format conversion: a copy of the batch (an MLP's inputs have no use for channels_last, the default).
COPIES = ("contiguous",)
# The collectives a Python caller can start (DDP's own gradient all-reduce runs inside its C++ reducer).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)


class Counter:
    """Counts the calls of the patched functions while `on`, by name."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, int] = {}

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.on:
                self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)


# What a pipeline step must not do: walk the stages' modules to set their mode (once an epoch is enough), or
# concatenate the last stage's micro-batch outputs (a language model's step counts tokens, not logits).
PIPELINE_WORK = {"train": (torch.nn.Module, "train"), "cat": (torch, "cat")}


def _between_log_points(
    rank: int,
    world_size: int,
    out_dir: str,
    steps: int,
    run: tuple[str, ...] = tuple(SMALL),
    also: tuple[str, ...] = (),
) -> dict[str, int]:
    """Train `steps` + 1 optimizer steps with train.log_every past them; count host reads, memory-format copies
    and Python-level collectives (and the PIPELINE_WORK named in `also`) from the end of the first step
    (start-up, memory probe) to the end of the loop."""
    cfg = load_config(
        None,
        [f"out_dir={out_dir}", *run, "train.batch_size=16", f"train.max_steps={steps + 1}"]
        + ["train.log_every=1000", "train.epochs=1", "report.curves=false"],
    )
    trainer = Trainer(cfg, dist_context(rank, world_size))
    assert trainer.steps_per_epoch > steps + 1  # the loop ends at max_steps, not at the epoch's last step
    counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS + COPIES}
    saved_dist = {name: getattr(dist, name) for name in COLLECTIVES}
    saved_sync = torch.cuda.synchronize
    for name in HOST_READS + COPIES:
        counter.wrap(torch.Tensor, name)
    for name in COLLECTIVES:
        counter.wrap(dist, name)
    counter.wrap(torch.cuda, "synchronize")
    extra = {name: PIPELINE_WORK[name] for name in also}
    saved_extra = {name: getattr(owner, attr) for name, (owner, attr) in extra.items()}
    for owner, attr in extra.values():
        counter.wrap(owner, attr)
    step, end = trainer.train_step, trainer.log.epoch_end

    def train_step(micro_batches):
        step(micro_batches)
        counter.on = True  # from the end of the first step on

    def epoch_end():
        counter.on = False
        end()

    trainer.train_step, trainer.log.epoch_end = train_step, epoch_end
    try:
        trainer.fit()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for name, fn in saved_dist.items():
            setattr(dist, name, fn)
        torch.cuda.synchronize = saved_sync
        for name, fn in saved_extra.items():
            setattr(*extra[name], fn)
    assert trainer.state.step == steps + 1
    return counter.calls


@pytest.mark.slow
def test_steps_between_log_points_read_nothing_from_the_device_and_start_no_collective(tmp_path):
    # 2 ranks (DDP over gloo), 12 steps between log points: the stop agreement, the non-finite check and the
    # progress line wait for a log point; the loss and accuracy sums stay on the device until then; the MLP's
    # batches are not converted to channels_last (model.channels_last=true, the default, is for convolutions).
    results = run_group(_between_log_points, 2, str(tmp_path / "run"), 12)
    assert results == [{}, {}], results


@pytest.mark.slow
def test_pipeline_steps_between_log_points_start_no_collective_but_the_schedules_own(tmp_path):
    # dist.pp=2 (the GPT cut in two, untied: no shared weight to sum): the stages' sends and receives are the
    # pipeline's own; the loss reaches the first stage's progress line at the log points only (before: a
    # broadcast after every step, a wait of every stage for the last). 4 steps between log points. Nor does a
    # step set the stages' mode (before: a walk of every module each step) or concatenate the last stage's
    # outputs, which a language model's step does not count from (before: kept and concatenated every step).
    text = tmp_path / "corpus.txt"
    text.write_text(GPT_TEXT)
    gpt = [a for a in GPT_RUN if not a.startswith("train.log_every")]
    run = (*gpt, f"data.root={text}", "dist.pp=2", "model.tie_embeddings=false", "train.log_every=1000")
    results = run_group(_between_log_points, 2, str(tmp_path / "run"), 4, run, tuple(PIPELINE_WORK))
    # (`contiguous` here is the stage edges' own: what a stage sends must be contiguous, a no-op when it is)
    assert [{k: n for k, n in r.items() if k != "contiguous"} for r in results] == [{}, {}], results


class _Recording:
    """A worker_init_fn that notes which worker process started, then runs the loader's own."""

    def __init__(self, kind: str, directory: str, inner):
        self.kind, self.directory, self.inner = kind, directory, inner

    def __call__(self, worker_id: int) -> None:
        Path(self.directory, f"{self.kind}-{os.getpid()}").touch()
        if self.inner is not None:
            self.inner(worker_id)


def test_loader_workers_start_once_per_run(tmp_path):
    # 2 epochs, each with an evaluation: one worker of each loader is started once and serves both epochs.
    starts = tmp_path / "starts"
    starts.mkdir()
    cfg = load_config(
        None,
        [f"out_dir={tmp_path / 'run'}", *SMALL, "train.batch_size=256", "train.epochs=2"]
        + ["data.num_workers=1", "report.curves=false"],
    )
    trainer = Trainer(cfg, dist_context(0, 1))
    for kind, loader in (("train", trainer.train_loader.loader), ("val", trainer.val_loader)):
        loader.worker_init_fn = _Recording(kind, str(starts), loader.worker_init_fn)
    trainer.fit()
    assert trainer.state.epoch == 2
    started = sorted(p.name.split("-")[0] for p in starts.iterdir())
    assert started == ["train", "val"], started
