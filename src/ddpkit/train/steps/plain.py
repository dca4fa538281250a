"""The step runner's interface, and the plain runner: one model wrapped by its strategy (dp, ddp, zero1/2, fsdp,
hsdp, with tensor parallelism over the mesh), fed train.grad_accum_steps micro-batches per optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from ddpkit.data.prefetch import to_device
from ddpkit.models import model_family
from ddpkit.parallel.compression import Compression
from ddpkit.parallel.experts.apply import apply_expert_parallel
from ddpkit.parallel.experts.meshes import expert_meshes
from ddpkit.parallel.materialize import wrap_made
from ddpkit.parallel.plan import build_strategy
from ddpkit.parallel.strategy import Strategy, ddp_options
from ddpkit.train.tasks import Task, evaluate


class StepRunner:
    """A layout's step, the plain one: `model` (this rank's modules: what the optimizer and the memory probe see)
    wrapped by `strategy` into `wrapped` (what forward runs; checkpoints read it through the strategy), fed
    train.grad_accum_steps micro-batches per step with the gradients synced on the last. `replica`: (this rank's
    data-parallel replica, replicas), what the loaders shard by; `counts`: this rank's sums are its replica's
    (tensor-parallel peers compute the same numbers)."""

    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        wrapped: nn.Module,
        replica: tuple[int, int],
        *,
        device: torch.device,
        task: Task,
        autocast: Callable[[], Any],
        scaler: torch.amp.GradScaler,
        accum: int,
        counts: bool = True,
        channels_last: bool = False,
        collective_eval: bool = False,
    ):
        self.model, self.strategy, self.wrapped, self.replica = model, strategy, wrapped, replica
        self.device, self.task, self.autocast, self.scaler = device, task, autocast, scaler
        self.accum, self.counts = accum, counts
        # channels_last inputs only for a model with convolutions (others would have them copied for nothing)
        self.channels_last = channels_last and any(p.dim() == 4 for p in model.parameters())
        self.collective_eval = collective_eval or strategy.collective_forward

    @property
    def clip_target(self) -> Any:
        """What ddpkit.clip_grad_norm_ takes the global norm over."""
        return self.model

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (None: every rank)."""
        return self.strategy.dp_group

    def loss_scale(self) -> float:
        """What a micro-batch's mean loss is multiplied by before its backward (1 / train.grad_accum_steps, and
        fp16's gradient scale): a loss the model joins in backward (a mixture of experts' auxiliary loss) is
        scaled so too."""
        return (self.scaler.get_scale() if self.scaler.is_enabled() else 1.0) / self.accum

    def routing_fields(self) -> dict[str, Any]:
        """The metrics of a mixture of experts' routing since the last call (train/steps/experts.py; collective
        there): none for a dense model."""
        return {}

    def train(self) -> None:
        """Training mode, once an epoch (evaluation switches to eval mode between epochs)."""
        self.wrapped.train()

    def begin_epoch(self, sums: Any) -> None:
        """An epoch begins; `sums` holds what a resume restored of it."""

    def shown_sums(self, sums: Any, done: int, steps: int, every: int) -> Any:
        """What the progress line after step `done` of `steps` shows (drawn every `every` steps): the sums."""
        return sums

    def forward_backward(
        self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], sums: Any
    ) -> list[torch.Tensor]:
        """One optimizer step's forward and backward over its micro-batches, counted into `sums`; returns their
        losses. Under DDP only the last micro-batch's backward all-reduces (no_sync before)."""
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            x, y = to_device(x, y, self.device, self.channels_last)
            with self.strategy.sync_context(self.wrapped, sync=i == self.accum - 1):
                with self.autocast():
                    logits = self.wrapped(x)
                loss = self.task.loss(logits, y)
                self.scaler.scale(loss / self.accum if self.accum > 1 else loss).backward()
            if self.counts:
                self.task.accumulate(sums, loss, logits, y)
            losses.append(loss)
        return losses

    @torch.no_grad()
    def evaluate(self, val_loader: Any) -> dict[str, Any]:
        """Exact evaluation: every validation sample scored once, whatever the world size."""
        return evaluate(
            self.strategy.eval_module(self.wrapped),
            val_loader,
            self.device,
            autocast=self.autocast,
            collective_forward=self.collective_eval,
            channels_last=self.channels_last,
            task=self.task,
            counts=self.counts,
        )


def build(
    cfg: Any, ctx: Any, model: nn.Module, *, layout: Any, mesh: Any, spec: Any, make: Any = None, **step: Any
) -> StepRunner:
    """The plain runner: the strategy over the data-parallel ranks (over the mesh's "dp" dim when tensor
    parallelism, HSDP or expert parallelism splits the ranks) wrapping the whole model, its routed experts split
    over dist.ep first; a model on the meta device made by `make` (parallel/materialize.py: after the wrap where
    that leaves each rank its shards only). model.compile: each block compiled before a sharded layout wraps it
    (FSDP2's gathers and tensor parallelism's collectives stay outside the compiled graphs, as torchtitan does),
    else the whole wrapped model."""
    experts = expert_meshes(mesh, layout.ep, layout.dp_shard) if layout.ep > 1 else None
    if experts is not None:
        apply_expert_parallel(model, experts)
    strategy = build_strategy(
        cfg.dist.strategy,
        ctx,
        ddp_options(cfg.dist),
        Compression.from_config(cfg.dist),
        mesh=mesh,
        offload=cfg.dist.offload,
        memory=cfg.dist.memory,
        dp_shard=layout.dp_shard,
        amp=cfg.train.amp,
        experts=experts,
    )
    blocks = model_family(cfg.model.arch, cfg.model).checkpointed
    per_block = blocks is not None and (layout.tp > 1 or "gradients" in strategy.entry.shards)
    for block in blocks(model) if cfg.model.compile and per_block else ():
        block.compile()  # in place: the parameter names (and checkpoints) stay the model's
    wrapped = wrap_made(strategy, model, make)
    if cfg.model.compile and not per_block:
        # in place (nn.Module.compile): the wrapper stays what the strategy returned, so checkpoints keep their
        # keys (no `_orig_mod.` prefix) and DDP's buckets still split the compiled graph
        wrapped.compile()
    coords = layout.coords(ctx.rank)
    autocast = strategy.step_autocast(step.pop("autocast"))  # none where FSDP2 casts the parameters itself
    return StepRunner(
        model,
        strategy,
        wrapped,
        (coords["dp"], layout.dp),  # tensor-parallel peers read the same samples
        counts=layout.counts(ctx.rank),
        collective_eval=layout.tp > 1 or layout.ep > 1,  # every forward a collective: ranks run as many
        autocast=autocast,
        **step,
    )
