"""A user's own model as a pipeline: what `ddpkit.prepare(model, ..., pp=2, pp_split=[...], loss_fn=...)` returns.

    model, optimizer, train_loader = ddpkit.prepare(
        model, optimizer, train_loader, pp=2, pp_split=["blocks.2"], loss_fn=F.cross_entropy
    )
    for x, y in train_loader:
        loss = model.step(x, y)      # forward and backward of the batch, in micro-batches; its mean loss
        optimizer.step()
        optimizer.zero_grad()
    model.eval()                            # as an nn.Module's: every stage module's mode (model.train() back)
    val_loss = model.evaluate(val_loader)   # loss_fn's mean over every validation sample, on every rank
    state = model.full_state()              # the whole model's state dict on rank 0 (None elsewhere)

Every rank calls the same methods with the same batches (the loaders prepare() returns give the ranks of one
pipeline the same samples). The model is cut where each module of `pp_split` begins, on the first batch it
sees: at module boundaries (pipeline.eager: each stage calls the model's own modules, eagerly), or, where the
forward cannot be cut there, by torch's pipeline tracer (said in one line); each rank keeps the stages it runs.
The optimizer stays the user's: the
parameters of stages this rank does not run get no gradient, so it leaves them alone. A parameter that stages of
several ranks use (a token embedding tied to the output head) is the model's own in each of them, its gradient
summed over those ranks after every step(), so each rank's copy takes the one-process update
(pipeline.split.retie). Loaders of one replica (pp = world size) keep the user's own order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.errors import UserError
from ddpkit.parallel.mesh import build_mesh, layout_of
from ddpkit.parallel.pipeline.eager import cut_stages
from ddpkit.parallel.pipeline.passing import described
from ddpkit.parallel.pipeline.plan import (
    SCHEDULES,
    check_microbatches,
    n_microbatches,
    stage_ids,
    stages_per_rank,
)
from ddpkit.parallel.pipeline.runner import PipelineRunner, full_state
from ddpkit.parallel.pipeline.split import check_split_names, micro_chunks


class PipelineModel:
    """A user's model cut into pipeline stages over `pp` ranks (data-parallel over the rest): step, evaluate,
    clip_grad_norm, full_state, and train/eval as an nn.Module has them."""

    def __init__(
        self,
        model: nn.Module,
        pp_split: Sequence[str],
        *,
        pp: int,
        loss_fn: Callable,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        device: torch.device | None = None,
        cut: Callable[[Sequence[int]], tuple] | None = None,
    ):
        if schedule not in SCHEDULES:
            raise UserError(
                f"ddpkit.prepare: unknown pp_schedule '{schedule}'", "use " + ", ".join(SCHEDULES)
            )
        if not dist.is_initialized() or dist.get_world_size() % pp:
            ws = dist.get_world_size() if dist.is_initialized() else 1
            raise UserError(
                f"ddpkit.prepare(pp={pp}) needs a multiple of {pp} processes, this job has {ws}",
                f"launch it with `ddpkit run --nproc-per-node {pp} script.py`",
            )
        check_split_names(model, list(pp_split), pp * stages_per_rank(schedule))
        self.model, self.names, self.loss_fn = model, list(pp_split), loss_fn
        # cut(stage ids) -> (those stages, their evaluation stages or None, the shared parameters): a model that
        # says how it is cut (a transformers model's pipeline plan, porting/hf_model.py); None: pipeline.eager
        self.cut = cut
        self.advice: str | None = None  # added to the hint of a stage's refusal (porting: a model inside)
        self.shape: tuple | None = None  # (shape, dtype) of every step's x: what the stages were built for
        self.pp, self.schedule = pp, schedule
        self.microbatches = n_microbatches(pp, microbatches)
        check_microbatches(self.microbatches, pp, schedule, where="ddpkit.prepare: ")
        self.device = device or torch.device("cpu")
        self.layout = layout_of(dist.get_world_size(), tp=1, pp=pp)
        self.coords = self.layout.coords(dist.get_rank())
        self.runner: PipelineRunner | None = None
        self.batch: int | None = None  # the batch size of every step
        self.fixed_batch: int | None = None  # the batch size evaluation feeds the stages (traced ones)
        self.asked: bool | None = None  # the mode train()/eval() set, given to stages cut later (None: unset)

    @property
    def training(self) -> bool:
        return self.model.training if self.asked is None else self.asked

    def train(self, mode: bool = True) -> PipelineModel:
        """Set training mode (`mode`) or evaluation mode on the model and on every stage module this rank runs,
        as nn.Module.train does; returns self."""
        self.asked = mode
        self.model.train(mode)
        if self.runner is not None:
            self.runner.train(mode)
        return self

    def eval(self) -> PipelineModel:
        """Evaluation mode (dropout off, batch norm on its running statistics): train(False)."""
        return self.train(False)

    def _built(self, x: torch.Tensor) -> PipelineRunner:
        """The runner, tracing the model on the first micro-batch seen."""
        if self.runner is None:
            mesh = build_mesh(self.layout, self.device.type)
            ids = stage_ids(self.coords["pp"], self.pp, self.schedule)
            if len(x) < self.microbatches:
                raise UserError(
                    f"a batch of {len(x)} samples is too small for {self.microbatches} pipeline micro-batches",
                    "use larger batches, or fewer pp_microbatches",
                )
            self.batch = len(x) // self.microbatches * self.microbatches
            example = (x[: self.batch // self.microbatches].to(self.device),)
            if self.cut is not None:
                stages, eval_stages, shared = self.cut(ids)
                traced = False
            else:
                stages, eval_stages, shared, traced = cut_stages(
                    self.model, self.names, example, ids, say=dist.get_rank() == 0
                )
            if traced:  # traced stages take one micro-batch size: evaluation cuts and pads to it
                self.fixed_batch = len(example[0])
            self.runner = PipelineRunner(
                stages,
                schedule=self.schedule,
                n_microbatches=self.microbatches,
                loss_fn=self.loss_fn,
                pp_group=mesh["pp"].get_group(),
                dp_group=mesh["dp"].get_group(),
                device=self.device,
                eval_stages=eval_stages,
                shared=shared,
            )
            if self.asked is not None:  # else each stage module keeps the mode the model gave it
                self.runner.train(self.asked)
        return self.runner

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch: gradients of its mean loss, in this rank's stages; returns that
        loss on every rank (averaged over the data-parallel replicas by their DDP, not here)."""
        if not isinstance(x, torch.Tensor):
            raise UserError(
                f"model.step(x, y) got {described(x)} as x; the pipeline's first stage takes one tensor",
                "pass the model's input as a tensor (e.g. the token ids: batch['input_ids'])",
            )
        micro_chunks(x, self.microbatches)
        runner = self._built(x)
        if len(x) != self.batch:
            raise UserError(
                f"model.step() got a batch of {len(x)} samples, the pipeline runs batches of {self.batch}",
                "give every step a batch of the same size (DataLoader(..., drop_last=True))",
            )
        if self.shape is not None and (tuple(x.shape), x.dtype) != self.shape:
            raise UserError(
                f"model.step() got x of shape {tuple(x.shape)} ({x.dtype}); the stages pass the shapes made "
                f"from x of shape {self.shape[0]} ({self.shape[1]})",
                "give every step x of one shape (pad or cut sequences)",
            )
        self.shape = (tuple(x.shape), x.dtype)
        try:
            return runner.step(x, y)[0]
        except UserError as e:
            raise UserError(e.what, f"{e.hint}; {self.advice}" if self.advice else e.hint) from None

    def grad_norm_parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter], Any]:
        """What ddpkit.clip_grad_norm_ asks (parallel/clip.py): its runner's parts, once the first step built it."""
        if self.runner is None:
            raise UserError(
                "ddpkit.clip_grad_norm_ before the pipeline's first step", "call it after model.step(x, y)"
            )
        return self.runner.grad_norm_parts()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of all stages together to 2-norm max_norm; returns the norm before clipping."""
        if self.runner is None:
            raise UserError("clip_grad_norm() before the first step()", "call it after model.step(x, y)")
        return self.runner.clip_grad_norm(max_norm)

    def evaluate(self, loader: Iterable) -> float:
        """loss_fn's mean over every sample of `loader` (loss_fn averaging over dim 0), on every rank."""

        def score(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            n = y.shape[0]
            return torch.stack(
                [self.loss_fn(out, y).double() * n, torch.tensor(float(n), dtype=torch.float64)]
            )

        batches = iter(loader)
        first = next(batches, None)
        if first is None and self.runner is None:
            raise UserError("evaluate() on an empty loader before any step()", "give it batches")
        runner = self._built(first[0]) if first is not None else self.runner

        def again():
            if first is not None:
                yield first
            yield from batches

        loss_sum, n = runner.evaluate(again(), score, 2, fixed_batch=self.fixed_batch).tolist()
        return loss_sum / n if n else float("nan")

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (full names) on rank 0, None elsewhere. Collective."""
        if self.runner is None:
            return self.model.state_dict() if dist.get_rank() == 0 else None
        return full_state(self.runner) or None

    @property
    def data_rank(self) -> tuple[int, int]:
        """(index, count) of this rank's data-parallel replica: what its loaders shard by."""
        return self.coords["dp"], self.layout.dp
