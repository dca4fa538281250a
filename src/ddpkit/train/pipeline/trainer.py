"""`ddpkit train` with dist.pp > 1: the model cut into this rank's stages, a PipelineRunner over the device
mesh, and the Strategy that checkpoints them in full-model form.

The Trainer asks `build` for the parts, calls `forward_backward` instead of its own forward/backward,
`ddpkit.clip_grad_norm_` (parallel/clip.py: over every stage) instead of torch's, and `evaluate` for exact
validation metrics. Checkpoints hold full-model names (the stages' state dicts gathered on rank 0) and the
optimizer state keyed by those names (parallel/pipeline/stage_state.py), so they load into any layout.
This is the Trainer's side of a pipeline; the cutting and the running live below it, in parallel/pipeline/.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ddpkit.models import model_family
from ddpkit.parallel.mesh import build_mesh, layout_of
from ddpkit.parallel.pipeline import stage_state
from ddpkit.parallel.pipeline.plan import n_microbatches, stage_ids
from ddpkit.parallel.pipeline.runner import PipelineRunner
from ddpkit.parallel.pipeline.split import traced_stages
from ddpkit.parallel.plan import build_strategy, pipeline_strategy
from ddpkit.parallel.strategy import Strategy as BaseStrategy
from ddpkit.parallel.strategy import get_strategy, picked
from ddpkit.train.builders import to_device
from ddpkit.train.metrics import RunningSums
from ddpkit.train.tasks import EVAL_WIDTH


@dataclass
class PipelineParts:
    runner: PipelineRunner
    layout: Any
    strategy: (
        str  # over the data-parallel ranks: one that replicates (DDP around each stage) or shards (FSDP2)
    )
    coords: dict
    modules: nn.ModuleList  # this rank's stages (what the optimizer and the memory probe see)
    fixed_batch: int | None  # traced stages take batches of exactly this size (evaluation pads to it)
    shown: Any = None  # a rank without the last stage: the loss its progress line shows (progress_sums)
    resumed: Any = None  # [loss sum, count] restored into this rank's sums at the epoch's start (a resume)

    def begin_epoch(self, sums) -> None:
        """A rank that runs no last stage keeps the partial sums a resume restored (`sums`: rank 0 holds them);
        its progress line adds to them what the last stage counted (progress_sums)."""
        if self.runner.last:
            return
        self.shown = RunningSums(sums.t.device, accuracy=False)
        self.resumed = sums.t[0::2].clone()

    def progress_sums(self, sums, done: int, steps: int, every: int):
        """What this rank's progress line shows after step `done` of `steps`: its own sums, or, on a rank without
        the last stage, the loss the last stage computed. That loss crosses the pipeline only where the line
        is drawn (every `every` steps and at the epoch's last: a collective of the pipeline's ranks there, none
        between), not after every step."""
        if done % every and done != steps:
            return None if self.shown is not None else sums
        counted = sums.t[0::2].clone() if self.runner.last else torch.zeros(2, dtype=torch.float64)
        counted = self.runner.from_last(counted.to(sums.t.device))
        if self.shown is None:
            return sums
        self.shown.t = torch.stack(
            [self.resumed[0] + counted[0], counted.new_zeros(()), self.resumed[1] + counted[1]]
        )
        return self.shown


def build(cfg, ctx, model: nn.Module, task, autocast, example_shape=None) -> PipelineParts:
    """This rank's stages of `model` and the runner feeding them (collective: builds the device mesh)."""
    d = cfg.dist
    layout = layout_of(ctx.world_size, d.tp, d.pp)
    coords = layout.coords(ctx.rank)
    mesh = build_mesh(layout, ctx.device.type)
    ids = stage_ids(coords["pp"], d.pp, d.pp_schedule)
    n_stages, micro = d.pp * len(ids), n_microbatches(d.pp, d.pp_microbatches)
    fixed = eval_stages = None
    shared: list = []
    family = model_family(cfg.model.arch)
    if family.pp_stage is not None:  # the family cuts itself (a rank running several stages cuts copies)
        stages = [family.pp_stage(copy.deepcopy(model) if len(ids) > 1 else model, s, n_stages) for s in ids]
    else:  # traced at its split points on one micro-batch of images, so every batch through it has that size
        fixed = cfg.train.batch_size // micro
        example = (torch.zeros(fixed, *example_shape, device=ctx.device),)
        splits = family.pp_split(cfg.model.arch, n_stages)
        stages, eval_stages, shared = traced_stages(model, splits, example, ids)
    if (
        layout.tp > 1
    ):  # each stage split over its tensor-parallel peers by the family's plan (the parts it holds)
        from ddpkit.parallel.mesh.tensor import apply_tensor_parallel

        stages = [apply_tensor_parallel(s, mesh["tp"], family=family) for s in stages]
    name, shard = pipeline_strategy(d.strategy, layout), None
    if not get_strategy(
        name
    ).replicates:  # FSDP2 over the dp dim of each (tensor-parallel) stage, as it shards a model
        sharding = build_strategy(name, ctx, mesh=mesh, dp_shard=d.dp_shard)

        def shard(edges: nn.Module) -> nn.Module:  # the stage's units, then the wrapper the schedule calls
            return sharding.shard(edges.stage, root=edges)

    runner = PipelineRunner(
        stages,
        schedule=d.pp_schedule,
        n_microbatches=micro,
        loss_fn=task.loss,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        device=ctx.device,
        autocast=autocast,
        counts=coords["tp"] == 0,
        eval_stages=eval_stages,
        shared=shared,
        shard=shard,
    )
    return PipelineParts(runner, layout, name, coords, nn.ModuleList(stages), fixed)


def forward_backward(trainer, micro_batches) -> None:
    """The pipeline's forward and backward of one optimizer step's batch, counted in the train sums once."""
    parts: PipelineParts = trainer.pipeline
    accum = trainer.cfg.train.grad_accum_steps
    for i, (x, y) in enumerate(micro_batches):  # train.grad_accum_steps batches, each through the schedule
        x, y = to_device(x, y, trainer.device, trainer.cfg.model.channels_last)
        # the loss on the last stage's rank only; its output only where the task counts from it (accuracy)
        loss, out = parts.runner.step(x, y, accumulate=i > 0, share_loss=False, outputs=trainer.task.accuracy)
        if loss is not None and parts.runner.counts:
            trainer.task.accumulate(trainer.state.sums, loss, out, y)
        if loss is not None:  # the non-finite check compares every rank's notes at the log points
            trainer.nonfinite.see(loss)
    if accum > 1:  # each schedule step's gradients are of its batch's mean loss: the step's are their mean
        for p in parts.runner.parameters():
            if p.grad is not None:
                p.grad.div_(accum)


def evaluate(trainer) -> dict[str, Any]:
    """Exact validation metrics (every sample once, forward only through the stages), on every rank."""
    parts: PipelineParts = trainer.pipeline
    sums = parts.runner.evaluate(trainer.val_loader, trainer.task.eval_sums, EVAL_WIDTH, parts.fixed_batch)
    return trainer.task.val_fields(sums.tolist())


class Strategy(BaseStrategy):
    """Checkpoints of a pipeline (parallel/pipeline/stage_state.py): full-model names and the optimizer state keyed by
    name (checkpoint.format=full), or each rank's stages in a DCP folder (sharded); both load into any layout."""

    def __init__(self, ctx, parts: PipelineParts):
        super().__init__(ctx)
        self.parts = parts
        replicated = get_strategy(
            parts.strategy
        ).replicates  # DDP around each stage: nothing to do over one dp
        self.name = parts.strategy if parts.layout.dp > 1 or not replicated else picked("one")

    @property
    def stages(self) -> list[nn.Module]:
        return self.parts.runner.stages

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def model_state(self, wrapped: nn.Module) -> dict:
        return stage_state.model_state(self.stages)

    def optimizer_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return stage_state.optimizer_state(self.stages, optimizer)

    def load(self, wrapped, optimizer, model_sd: dict, optim_sd: dict | None) -> None:
        stage_state.load_state(self.stages, optimizer, model_sd, optim_sd)

    def sharded_state(self, wrapped: nn.Module, optimizer) -> tuple[dict, dict]:
        return stage_state.sharded_state(self.stages, optimizer)

    def load_sharded(self, wrapped: nn.Module, optimizer, path, side: dict) -> None:
        stage_state.load_sharded(path, self.stages, optimizer, side)
