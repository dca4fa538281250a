"""The step runner of `ddpkit train` with dist.pp > 1: the model cut into this rank's stages, a PipelineRunner
over the device mesh feeding them, and the Strategy that checkpoints them in full-model form.

Its step runs each micro-batch through the schedule, `ddpkit.clip_grad_norm_` (parallel/clip.py) takes the norm
over every stage, and evaluation runs forward through the stages. Checkpoints hold full-model names (the stages'
state dicts gathered on rank 0) and the optimizer state keyed by those names (parallel/pipeline/stage_state.py),
so they load into any layout. The cutting and the running live below, in parallel/pipeline/.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from ddpkit.data.prefetch import to_device
from ddpkit.models import model_family
from ddpkit.parallel.experts.apply import apply_expert_parallel
from ddpkit.parallel.experts.meshes import expert_meshes
from ddpkit.parallel.mesh import Layout, build_mesh
from ddpkit.parallel.mesh.tensor import apply_tensor_parallel
from ddpkit.parallel.pipeline import stage_state
from ddpkit.parallel.pipeline.plan import n_microbatches, stage_ids
from ddpkit.parallel.pipeline.runner import PipelineRunner
from ddpkit.parallel.pipeline.split import traced_stages
from ddpkit.parallel.plan import build_strategy, pipeline_strategy
from ddpkit.parallel.strategy import Strategy, get_strategy, picked
from ddpkit.train.metrics import RunningSums
from ddpkit.train.steps.plain import StepRunner
from ddpkit.train.tasks import EVAL_WIDTH


def takes(cfg: Any) -> bool:
    """A pipeline runs the steps of a model cut into dist.pp > 1 stages."""
    return cfg.dist.pp > 1


class PipelineSteps(StepRunner):
    """This rank's stages (`model`: a ModuleList, what the optimizer and the memory probe see) fed by `runner`;
    `fixed_batch`: traced stages take batches of exactly this size (evaluation pads to it)."""

    def __init__(self, runner: PipelineRunner, stages: list[nn.Module], layout: Layout, name: str,
                 fixed_batch: int | None, ctx, **step):  # fmt: skip
        coords = layout.coords(ctx.rank)
        stages = nn.ModuleList(stages)
        self.runner, self.layout, self.strategy_name, self.fixed_batch = runner, layout, name, fixed_batch
        self.shown: Any = None  # a rank without the last stage: the loss its progress line shows
        self.resumed: Any = None  # [loss sum, count] restored into this rank's sums at the epoch's start
        # the ranks of one pipeline read the same samples: the loaders shard over the data-parallel replicas
        super().__init__(
            stages,
            StageCheckpoints(ctx, self),
            stages,
            (coords["dp"], layout.dp),
            counts=runner.counts,
            **step,
        )

    @property
    def clip_target(self) -> Any:
        return self.runner  # the norm over every stage of every pipeline rank

    @property
    def dp_group(self) -> Any:
        return self.runner.dp_group

    def loss_scale(self) -> float:
        return 1.0  # the schedule divides the gradients by the micro-batches, forward_backward by the steps

    def begin_epoch(self, sums: Any) -> None:
        """A rank that runs no last stage keeps the partial sums a resume restored (`sums`: rank 0 holds them);
        its progress line adds to them what the last stage counted (shown_sums)."""
        if self.runner.last:
            return
        self.shown = RunningSums(sums.t.device, accuracy=False)
        self.resumed = sums.t[0::2].clone()

    def shown_sums(self, sums: Any, done: int, steps: int, every: int) -> Any:
        """This rank's own sums, or, on a rank without the last stage, the loss the last stage computed. That loss
        crosses the pipeline only where the line is drawn (every `every` steps and at the epoch's last: a
        collective of the pipeline's ranks there, none between), not after every step."""
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

    def forward_backward(self, micro_batches, sums) -> list[torch.Tensor]:
        """Each of the step's train.grad_accum_steps batches through the schedule, counted in `sums` once (the loss
        on the last stage's rank only; its output only where the task counts from it: accuracy)."""
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            x, y = to_device(x, y, self.device, self.channels_last)
            loss, out = self.runner.step(x, y, accumulate=i > 0, share_loss=False, outputs=self.task.accuracy)
            if loss is not None and self.runner.counts:
                self.task.accumulate(sums, loss, out, y)
            if loss is not None:
                losses.append(loss)
        if (
            self.accum > 1
        ):  # each schedule step's gradients are of its batch's mean loss: the step's are their mean
            for p in self.runner.parameters():
                if p.grad is not None:
                    p.grad.div_(self.accum)
        return losses

    def evaluate(self, val_loader: Any) -> dict[str, Any]:
        """Exact validation metrics (every sample once, forward only through the stages), on every rank."""
        sums = self.runner.evaluate(val_loader, self.task.eval_sums, EVAL_WIDTH, self.fixed_batch)
        return self.task.val_fields(sums.tolist())


def _split_stages(stages: list, mesh: Any, layout: Layout, family: Any) -> tuple[list, Any]:
    """Each stage split over its tensor-parallel peers by the family's plan (the parts it holds), and its routed
    experts over its ep peers; with the experts' meshes (None without dist.ep)."""
    if layout.tp > 1:
        stages = [apply_tensor_parallel(s, mesh["tp"], family=family) for s in stages]
    experts = expert_meshes(mesh, layout.ep, layout.dp_shard) if layout.ep > 1 else None
    if experts is not None:
        stages = [apply_expert_parallel(s, experts) for s in stages]
    return stages, experts


def build(
    cfg, ctx, model: nn.Module, *, layout: Layout, mesh: Any, spec: Any, make: Any = None, **step
) -> PipelineSteps:
    """This rank's stages of `model` and the runner feeding them (collective: builds the device mesh; `mesh`, the
    plain runner's, is None here). A model on the meta device is cut and split there, and `make` makes each of
    this rank's stages (parallel/materialize.py): after FSDP2 shards them, before DDP wraps them."""
    d = cfg.dist
    coords = layout.coords(ctx.rank)
    mesh = build_mesh(layout, ctx.device.type)
    ids = stage_ids(coords["pp"], d.pp, d.pp_schedule)
    n_stages, micro = d.pp * len(ids), n_microbatches(d.pp, d.pp_microbatches)
    fixed = eval_stages = None
    shared: list = []
    family = model_family(cfg.model.arch, cfg.model)
    if family.pp_stage is not None:  # the family cuts itself (a rank running several stages cuts copies)
        stages = [family.pp_stage(copy.deepcopy(model) if len(ids) > 1 else model, s, n_stages) for s in ids]
    else:  # traced at its split points on one micro-batch of images, so every batch through it has that size
        if make is not None:  # the tracer runs the model: made whole first
            model, make = make(model), None
        fixed = cfg.train.batch_size // micro
        example = (torch.zeros(fixed, spec.in_channels, spec.image_size, spec.image_size, device=ctx.device),)
        splits = family.pp_split(cfg.model.arch, n_stages)
        stages, eval_stages, shared = traced_stages(model, splits, example, ids)
    stages, experts = _split_stages(stages, mesh, layout, family)
    name, shard = pipeline_strategy(d.strategy, layout), None
    replicated = get_strategy(name).replicates
    for stage in stages if make is not None and replicated else ():
        make(stage)  # whole on each replica, before DDP broadcasts it
    if not replicated:  # FSDP2 over the dp dim of each (tensor-parallel) stage
        sharding = build_strategy(
            name, ctx, mesh=mesh, dp_shard=d.dp_shard, amp=cfg.train.amp, experts=experts, memory=d.memory
        )
        step["autocast"] = sharding.step_autocast(step["autocast"])  # none where FSDP2 casts itself

        def shard(edges: nn.Module) -> nn.Module:  # the stage's units, then the wrapper the schedule calls
            return sharding.shard(edges.stage, root=edges)

    runner = PipelineRunner(
        stages,
        schedule=d.pp_schedule,
        n_microbatches=micro,
        loss_fn=step["task"].loss,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        device=ctx.device,
        autocast=step["autocast"],
        counts=coords["tp"] == 0,
        eval_stages=eval_stages,
        shared=shared,
        shard=shard,
        experts=experts,
    )
    for stage in stages if make is not None and not replicated else ():
        make(stage)  # each rank its FSDP2 shards only
    return PipelineSteps(runner, stages, layout, name, fixed, ctx, **step)


class StageCheckpoints(Strategy):
    """Checkpoints of a pipeline (parallel/pipeline/stage_state.py): full-model names and the optimizer state keyed
    by name (checkpoint.format=full), or each rank's stages in a DCP folder (sharded); both load into any
    layout."""

    def __init__(self, ctx, steps: PipelineSteps):
        super().__init__(ctx)
        self.steps = steps
        replicated = get_strategy(steps.strategy_name).replicates  # DDP around each stage: one dp has nothing
        self.name = steps.strategy_name if steps.layout.dp > 1 or not replicated else picked("one")

    @property
    def stages(self) -> list[nn.Module]:
        return self.steps.runner.stages

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
