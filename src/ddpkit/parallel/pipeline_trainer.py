"""`ddpkit train` with dist.pp > 1: the model cut into this rank's stages, a PipelineRunner over the device
mesh, and the Strategy that checkpoints them in full-model form.

The Trainer asks `build_pipeline` for the parts, calls `pipeline_forward_backward` instead of its own
forward/backward, `PipelineRunner.clip_grad_norm` instead of torch's, and `pipeline_evaluate` for exact
validation metrics. Checkpoints hold full-model names (the stages' state dicts gathered on rank 0) and the
optimizer state keyed by those names, so they load into any pipeline layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.parallel.mesh import build_mesh, layout_of
from ddpkit.parallel.pipeline import PipelineRunner, first_replica, full_state, load_full_state
from ddpkit.parallel.pipeline_plan import n_microbatches, resnet_splits, stage_ids
from ddpkit.parallel.pipeline_split import gpt_stage, traced_stages
from ddpkit.parallel.strategy import Strategy


@dataclass
class PipelineParts:
    runner: PipelineRunner
    layout: Any
    coords: dict
    modules: nn.ModuleList  # this rank's stages (what the optimizer and the memory probe see)
    fixed_batch: int | None  # traced stages take batches of exactly this size (evaluation pads to it)


def build_pipeline(cfg, ctx, model: nn.Module, task, autocast, example_shape=None) -> PipelineParts:
    """This rank's stages of `model` and the runner feeding them (collective: builds the device mesh)."""
    d = cfg.dist
    layout = layout_of(ctx.world_size, d.tp, d.pp)
    coords = layout.coords(ctx.rank)
    mesh = build_mesh(layout, ctx.device.type)
    ids = stage_ids(coords["pp"], d.pp, d.pp_schedule)
    n_stages, micro = d.pp * len(ids), n_microbatches(d.pp, d.pp_microbatches)
    fixed = eval_stages = None
    if cfg.model.arch == "gpt":
        stages = [gpt_stage(model, s, n_stages, copy_model=len(ids) > 1) for s in ids]
    else:  # a ResNet: traced on one micro-batch of images, so every batch through it has that size
        fixed = cfg.train.batch_size // micro
        example = (torch.zeros(fixed, *example_shape, device=ctx.device),)
        stages, eval_stages = traced_stages(model, resnet_splits(n_stages), example, ids)
    if layout.tp > 1:  # each stage split over its tensor-parallel peers by the GPT plan (the parts it holds)
        from ddpkit.parallel.tensor import apply_tensor_parallel

        stages = [apply_tensor_parallel(s, mesh["tp"]) for s in stages]
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
    )
    return PipelineParts(runner, layout, coords, nn.ModuleList(stages), fixed)


def pipeline_forward_backward(trainer, micro_batches) -> None:
    """The pipeline's forward and backward of one optimizer step's batch, counted in the train sums once."""
    from ddpkit.builders import to_device

    parts: PipelineParts = trainer.pipeline
    for x, y in micro_batches:  # one batch: grad_accum_steps is 1 under a pipeline
        x, y = to_device(x, y, trainer.device, trainer.cfg.model.channels_last)
        loss, out = parts.runner.step(x, y)
        if out is not None and parts.runner.counts:
            trainer.task.accumulate(trainer.state.sums, loss, out, y)
        trainer.nonfinite.see(loss)


def pipeline_evaluate(trainer) -> dict[str, Any]:
    """Exact validation metrics (every sample once, forward only through the stages), on every rank."""
    from ddpkit.tasks import EVAL_WIDTH

    parts: PipelineParts = trainer.pipeline
    sums = parts.runner.evaluate(trainer.val_loader, trainer.task.eval_sums, EVAL_WIDTH, parts.fixed_batch)
    return trainer.task.val_fields(sums.tolist())


class PipelineStrategy(Strategy):
    """Checkpoints of a pipeline: full-model names, the optimizer state keyed by parameter name."""

    def __init__(self, ctx, parts: PipelineParts):
        super().__init__(ctx)
        self.parts = parts
        self.name = "ddp" if parts.layout.dp > 1 else "single"

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def model_state(self, wrapped: nn.Module) -> dict | None:
        return full_state(self.parts.runner)

    def optimizer_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        return named_optimizer_state(self.parts.runner, optimizer)

    def load(self, wrapped, optimizer, model_sd: dict, optim_sd: dict | None) -> None:
        load_full_state(self.parts.runner, model_sd)
        if optimizer is not None and optim_sd is not None:
            load_named_optimizer_state(self.parts.runner, optimizer, optim_sd)


def named_optimizer_state(runner: PipelineRunner, optimizer: torch.optim.Optimizer) -> dict | None:
    """The optimizer state of every stage keyed by full-model parameter name, on rank 0 (None elsewhere):
    `{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}` (the format of
    torch.distributed.checkpoint.state_dict, which other layouts read). Collective."""
    sd = optimizer.state_dict()
    names = [n for n, _ in runner.named_parameters()]  # the optimizer's order: built over the stages in turn
    mine = {
        "state": {names[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
    }
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if runner.counts and first_replica(runner) else None, parts, dst=0)
    if parts is None:
        return None
    parts = [p for p in parts if p is not None]
    groups = [dict(g, params=[]) for g in parts[0]["param_groups"]]
    for part in parts:
        for joined, g in zip(groups, part["param_groups"], strict=True):
            joined["params"] += g["params"]
    return {"state": {k: v for part in parts for k, v in part["state"].items()}, "param_groups": groups}


def load_named_optimizer_state(runner: PipelineRunner, optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """A name-keyed optimizer state (named_optimizer_state's format) into this rank's optimizer."""
    saved = sd.get("param_groups") or []
    if not all(isinstance(n, str) for g in saved for n in g.get("params", [])):
        raise ValueError("the optimizer state is not keyed by parameter name")
    names = [n for n, _ in runner.named_parameters()]
    own = optimizer.state_dict()
    state = {i: sd["state"][n] for i, n in enumerate(names) if n in sd["state"]}
    groups = [{**s, "params": g["params"]} for g, s in zip(own["param_groups"], saved, strict=True)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
