"""Pipeline parallelism: the model cut into stages over `dist.pp` ranks, micro-batches fed through them by a
torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ones: interleaved
zero bubble, ZB-V and DualPipeV).

`PipelineRunner` is what the Trainer (when dist.pp > 1) and `ddpkit.prepare(..., pp=...)` drive:

    loss = runner.step(x, y)          # forward + backward of one batch in micro-batches; loss on every rank
    runner.clip_grad_norm(max_norm)   # optional: the norm over all stages
    optimizer.step(); optimizer.zero_grad()
    sums = runner.evaluate(loader, score, width)   # exact: forward only, sums from the last stage, all ranks

Each rank runs its stages (plain modules holding full-model parameter names); with several data-parallel
replicas each stage is wrapped in DDP over the mesh's "dp" group, or sharded with FSDP2 over it (`shard`: fsdp,
zero2, hsdp; torch's schedules reduce the stages' gradients once per step). `full_state(runner)` gathers the stages'
state dicts into one full-model state dict (what a full-format checkpoint stores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.parallel.clip import clip_grad_norm_
from ddpkit.parallel.experts.apply import expert_modules, ignore_in_ddp, reduce_expert_grads
from ddpkit.parallel.pipeline import stage_state
from ddpkit.parallel.pipeline.passing import check_output, checked_loss, refusal
from ddpkit.parallel.pipeline.plan import SPLIT_BACKWARD, stage_ids, stage_rank
from ddpkit.parallel.pipeline.split import owned_parameters

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEADER = 10  # ndim, up to 8 sizes, dtype code


def _schedule_class(name: str):
    from torch.distributed import pipelining as pl

    return {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
        "interleaved_zb": pl.ScheduleInterleavedZeroBubble,
        "zbv": pl.ScheduleZBVZeroBubble,
        "dualpipev": pl.ScheduleDualPipeV,
    }[name]


def _local(t):
    """A DTensor's full value (collective over its mesh); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _ContiguousGrad(torch.autograd.Function):
    """Identity; the gradient it passes back is made contiguous (a channels_last convolution gives its input's
    gradient in channels_last, and point-to-point sends take contiguous tensors only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ContiguousEdges(nn.Module):
    """A stage whose inputs' gradients and whose outputs are contiguous: what it sends to its neighbour stages
    (activations forward, gradients backward) in the layout a send takes, whatever memory format it computes in
    (model.channels_last). Values are unchanged. (The inputs' gradients need it although the `.grad` a schedule
    sends is laid out as the input: on the first step torch lays the previous stage's receive buffer out as the
    stage computed that gradient, and gloo refuses to receive into a buffer that is not contiguous.)"""

    def __init__(self, stage: nn.Module, index: int = 0, n_stages: int = 1):
        super().__init__()
        self.stage = stage
        self.index, self.n_stages = index, n_stages  # which stage: what it gives is checked (passing.py)

    def forward(self, *args):
        args = tuple(
            _ContiguousGrad.apply(a)
            if torch.is_tensor(a) and a.is_floating_point() and a.requires_grad
            else a
            for a in args
        )
        out = self.stage(*args)
        check_output(out, self.stage, self.index, self.n_stages)
        if isinstance(out, tuple):
            return tuple(o.contiguous() if torch.is_tensor(o) else o for o in out)
        return out.contiguous() if torch.is_tensor(out) else out


class PipelineRunner:
    """This rank's stages of a pipeline, and the schedule that feeds them.

    `stages`: the modules of the stages this rank runs (stage indices from `pipeline.plan.stage_ids`);
    `eval_stages`: traced stages' eval-mode twins (evaluation runs them on `stages`' parameters and buffers);
    `loss_fn(output, target)`: the mean loss of one micro-batch, on the last stage; `counts`: this rank's
    last-stage results are the ones counted (one rank per pipeline when tensor-parallel ranks repeat them);
    `shard(module)`: FSDP2 over the data-parallel ranks in place of DDP (fully_shard on the module a stage runs).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable,
        pp_group,
        dp_group=None,
        device: torch.device | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        counts: bool = True,
        eval_stages: Sequence[nn.Module] | None = None,
        shared: Sequence = (),
        shard: Callable[[nn.Module], nn.Module] | None = None,
        experts: Any = None,
    ):
        from torch.distributed.pipelining import PipelineStage

        self.pp_group, self.dp_group = pp_group, dp_group
        self.pp, self.pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.ids = stage_ids(self.pp_rank, self.pp, schedule)
        self.n_stages = self.pp * len(self.ids)
        self.stages = list(stages)
        self.eval_stages = list(eval_stages) if eval_stages is not None else None
        self.n_microbatches, self.schedule_name = n_microbatches, schedule
        self.device = device or torch.device("cpu")
        self.autocast, self.counts = autocast, counts
        self.first, self.last = 0 in self.ids, self.n_stages - 1 in self.ids
        # parameters used by stages of several ranks (pipeline.split.Shared): their gradients summed over those
        # ranks after each backward, so every copy takes the one-process update
        self.shared = [s for s in shared if len({self._pp_rank(sid) for sid in s.stages}) > 1]
        self.shard, self.experts = shard, experts
        # a zero-bubble schedule computes the weights' gradients apart from the backward (and out of micro-batch
        # order), which DDP's reducer cannot follow: the replicas' gradients are averaged after the step instead
        self.average_after = (
            shard is None
            and schedule in SPLIT_BACKWARD
            and dp_group is not None
            and dist.get_world_size(dp_group) > 1
        )
        self.wrapped = [self._wrap(m, sid) for m, sid in zip(self.stages, self.ids, strict=True)]
        self.ddp = [w for w in self.wrapped if isinstance(w, nn.parallel.DistributedDataParallel)]
        self.pipe_stages = [
            PipelineStage(w, sid, self.n_stages, self.device, group=pp_group)
            for w, sid in zip(self.wrapped, self.ids, strict=True)
        ]
        cls = _schedule_class(schedule)
        self.schedule = cls(
            self.pipe_stages if len(self.pipe_stages) > 1 else self.pipe_stages[0],
            n_microbatches,
            loss_fn=checked_loss(loss_fn),
        )

    def _wrap(self, module: nn.Module, sid: int) -> nn.Module:
        module = ContiguousEdges(module, sid, self.n_stages)
        if self.shard is not None:  # FSDP2: every forward gathers the stage's parameters (a collective)
            return self.shard(module)
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1 or self.average_after:
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        # every forward through it runs under no_sync (step()), and torch's stage starts the gradients' reduction
        # itself in the last micro-batch's backward: DDP needs no search for unused parameters. The experts split
        # over dist.ep (and a mixture of experts' per-rank counts) it leaves alone: step() reduces them
        return DDP(ignore_in_ddp(module), process_group=self.dp_group)

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's no_sync over the step: torch's schedules run their forwards under it and reduce the gradients
        in the last backward themselves, but on the first step they infer the stages' shapes by a forward and
        backward through the module outside it, which without this leaves DDP's reducer with every parameter
        recorded twice (GPipe's next forward then fails DDP's bucket rebuild, torch 2.14)."""
        if not self.ddp:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for w in self.ddp:
            stack.enter_context(w.no_sync())
        return stack

    # ---- the parameters this rank owns ---------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) of this rank's stages."""
        return owned_parameters(self.stages)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def train(self, mode: bool = True) -> PipelineRunner:
        for m in self.stages:
            m.train(mode)
        return self

    # ---- training -------------------------------------------------------------------------------------
    def _pp_rank(self, stage: int) -> int:
        """The rank of this pipeline (0 .. pp - 1) running `stage`."""
        return stage_rank(stage, self.pp, self.schedule_name)

    def _owner(self, stage: int) -> int:
        """The global rank running `stage` in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, self._pp_rank(stage))

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        accumulate: bool = False,
        share_loss: bool = True,
        outputs: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward and backward of one batch (cut into the micro-batches) in the stages' own mode (train() or
        eval(), as the caller set it: `evaluate` puts back the mode it found); gradients are those of the
        batch's mean loss (`accumulate`: added to the gradients already there). Returns that loss (detached)
        on every rank of the pipeline (`share_loss=False`: on the last stage's rank only, None elsewhere, and
        no collective), and with `outputs` the last stage's output of the whole batch on the rank running it
        (None elsewhere, and None without `outputs`: the schedule then keeps no micro-batch's output)."""
        # the schedule divides every gradient by the micro-batches at its end, those already there too: they
        # are set aside and added back
        params = self.parameters() if accumulate else []
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None
        losses: list[torch.Tensor] = []
        args = (x.to(self.device),) if self.first else ()
        target = y.to(self.device) if self.last else None
        with self.autocast(), self._no_sync():
            try:
                out = self.schedule.step(
                    *args, target=target, losses=losses, return_outputs=outputs and self.last
                )
            except Exception as e:
                told = refusal(e)
                if told is None:
                    raise
                raise told from None
        loss = torch.stack([v.detach().float() for v in losses]).mean() if self.last else None
        if share_loss:
            loss = self.from_last(loss if loss is not None else torch.zeros((), device=self.device))
        if self.average_after:
            self._average_over_replicas()
        self._sum_shared_grads()
        if self.experts is not None and (self.shard is None or not self.experts.shardable):  # not FSDP2's
            for stage in self.stages:
                reduce_expert_grads(stage, self.experts)
        for p, g in zip(params, kept, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return loss, (_local(out).detach() if out is not None else None)

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the last stage's rank holds it, on every rank of this pipeline (collective over it; the other
        ranks pass a tensor of the same shape and dtype, which is overwritten)."""
        dist.broadcast(t, src=self._owner(self.n_stages - 1), group=self.pp_group)
        return t

    def _average_over_replicas(self) -> None:
        """Each gradient of this rank's stages averaged over the data-parallel replicas, as DDP would (one
        all-reduce per dtype of the flattened gradients)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        # the experts split over dist.ep: each rank's own, reduced over the edp ranks (reduce_expert_grads)
        split = (
            {id(p) for m in self.stages for e in expert_modules(m) for p in e.parameters()}
            if self.experts
            else ()
        )
        for p in self.parameters():
            if p.grad is not None and id(p) not in split:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        n = dist.get_world_size(self.dp_group)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(n)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))

    def _uses(self, shared) -> bool:
        return any(sid in self.ids for sid in shared.stages)

    def _sum_shared_grads(self) -> None:
        """Each shared parameter's gradient: the sum of the stages' parts that use it, on every rank holding it."""
        for s in self.shared:
            p = s.param
            grad = p.grad if self._uses(s) and p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=self.pp_group)
            if self._uses(s):
                p.grad = grad

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters with a shared one counted on the first rank that uses it only (what the
        pipeline's gradient norm sums over its ranks)."""
        skip = {id(s.param) for s in self.shared if min(map(self._pp_rank, s.stages)) != self.pp_rank}
        return [p for p in self.parameters() if id(p) not in skip]

    def grad_norm_parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter], Any]:
        """What ddpkit.clip_grad_norm_ asks of a part of the model (parallel/clip.py): this rank's parameters,
        those its part of the norm counts, and the group of the pipeline's ranks that hold the other parts."""
        return self.parameters(), self.norm_parameters(), self.pp_group

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so that their joint 2-norm is at most max_norm; returns that norm."""
        return clip_grad_norm_(self, max_norm)

    # ---- evaluation -----------------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, stage: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = t.dim()
        header[1 : 1 + t.dim()] = torch.tensor(t.shape)
        header[-1] = _DTYPES.index(t.dtype)
        dst = self._owner(stage)
        dist.send(header.to(self.device), dst=dst, group=self.pp_group)
        dist.send(t.contiguous(), dst=dst, group=self.pp_group)

    def _recv(self, stage: int) -> torch.Tensor:
        src = self._owner(stage)
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.pp_group)
        h = header.tolist()
        t = torch.empty(h[1 : 1 + h[0]], dtype=_DTYPES[h[-1]], device=self.device)
        dist.recv(t, src=src, group=self.pp_group)
        return t

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """One batch forward through every stage in turn (no micro-batches, no schedule): the last stage's
        output on the rank running it, None elsewhere. Every rank of the pipeline calls it."""
        h, out = x.to(self.device), None
        for k, sid in enumerate(self.ids):
            if sid > 0 and sid - 1 not in self.ids:  # else the previous stage ran here: h is its output
                h = self._recv(sid - 1)
            with self.autocast():
                h = self._eval_forward(k, h)
            if sid == self.n_stages - 1:
                out = _local(h)
                continue
            h = h.to_local() if hasattr(h, "to_local") else h  # a tensor-parallel rank's own part
            if sid + 1 not in self.ids:
                self._send(h, sid + 1)
        return out

    def _eval_forward(self, k: int, h: torch.Tensor):
        if self.eval_stages is None:  # a sharded stage through its FSDP2 root, which gathers its parameters
            return (self.wrapped[k] if self.shard is not None else self.stages[k])(h)
        stage = self.stages[k]
        tensors = {
            **dict(stage.named_parameters(remove_duplicate=False)),
            **dict(stage.named_buffers(remove_duplicate=False)),
        }
        return torch.func.functional_call(self.eval_stages[k], tensors, (h,))

    @torch.no_grad()
    def evaluate(
        self,
        loader: Iterable,
        score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        width: int,
        fixed_batch: int | None = None,
    ) -> torch.Tensor:
        """`score(output, y)` (a float64 vector of `width` sums) summed over every batch of `loader` and every
        data-parallel replica, on every rank. Exact under every schedule: each sample goes forward once.

        fixed_batch: the stages take batches of exactly this size (traced stages): batches are cut into such
        pieces, the last one padded with repeats of its first sample, whose outputs are not scored."""
        was = self.stages[0].training
        self.train(False)
        sums = torch.zeros(width, dtype=torch.float64, device=self.device)
        dummy, forwards = None, 0
        for x, y in loader:
            for xs, ys in _pieces(x, y, fixed_batch):
                out, forwards = self.forward(xs), forwards + 1
                dummy = xs if len(xs) else dummy
                if out is not None and self.counts and len(ys):
                    sums += score(out[: len(ys)].float(), ys.to(self.device)).to(sums)
        self._even_out(forwards, loader, dummy)
        dist.all_reduce(sums)  # only the counted last-stage ranks hold non-zero sums
        self.train(was)
        return sums

    def _even_out(self, forwards: int, loader: Iterable, dummy: torch.Tensor | None) -> None:
        """Sharded stages or experts split over dist.ep: a replica that ran fewer forwards than another runs
        unscored ones until it has run as many (each forward is a collective over the data-parallel ranks), on a
        piece it ran before."""
        if self.shard is None and self.experts is None:
            return
        most = torch.tensor([forwards], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if dummy is None:
            dummy = loader.dataset[0][0].unsqueeze(0)
        for _ in range(int(most.item()) - forwards):
            self.forward(dummy)


def _pieces(x: torch.Tensor, y: torch.Tensor, size: int | None):
    """(x, y) as is, or cut into pieces of `size` samples, x of the last one padded to `size`."""
    if size is None:
        yield x, y
        return
    for start in range(0, len(x), size):
        xs, ys = x[start : start + size], y[start : start + size]
        if len(xs) < size:
            xs = torch.cat([xs, xs[:1].expand(size - len(xs), *xs.shape[1:])])
        yield xs, ys


def full_state(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    """The full model's state dict (full-model names, every stage's entries, CPU tensors) on global rank 0, an
    empty dict elsewhere. Collective over all ranks."""
    return stage_state.model_state(runner.stages)
