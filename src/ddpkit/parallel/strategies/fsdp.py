"""fsdp: FSDP2 (fully_shard), ZeRO-3: parameters, gradients and optimizer state sharded over the ranks.

Over the "dp" dim of the device mesh when the model is split (tensor parallel: FSDP2 shards the DTensors further;
a pipeline: each stage, train/steps/pipeline.py); dist.offload=cpu keeps the shards, their gradients and the
optimizer state in CPU memory (CPUOffloadPolicy); train.amp=bf16 is FSDP2's own mixed precision
(MixedPrecisionPolicy: bf16 gathers and compute, float32 reduce-scatters and master weights) instead of autocast over
float32 gathers. The base Strategy gathers and scatters the full state of the DTensor parameters.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ddpkit.distributed.allocator import lean_heap
from ddpkit.parallel.strategy import Strategy, StrategyEntry

if TYPE_CHECKING:
    import torch.nn as nn


class FSDPStrategy(Strategy):
    name = "fsdp"
    reshard_after_forward: bool | None = (
        None  # torch's default, ZeRO-3: gathered for forward and again for backward
    )

    def shard_options(self, root: bool = False) -> dict:
        """fully_shard's keyword arguments for a unit, or the `root` (a subclass changes what is resharded or
        offloaded)."""
        options: dict = {}
        if self.reshard_after_forward is not None:
            options["reshard_after_forward"] = self.reshard_after_forward
        if self.dp_mesh is not None:
            options["mesh"] = self.dp_mesh
        if self.offload == "cpu":
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
        if self.amp == "bf16":
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            # FSDP2's own mixed precision: parameters all-gathered and computed in bf16 (half the bytes of a
            # float32 gather), gradients reduce-scattered and kept in float32 beside float32 master shards; the
            # root's output (the logits) in float32, where the loss is taken, as under autocast
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                output_dtype=torch.float32 if root else None,
            )
        return options

    def step_autocast(self, autocast):
        return contextlib.nullcontext if self.amp == "bf16" else autocast

    def wrap(self, model: nn.Module) -> nn.Module:
        import torch

        if any(not p.is_contiguous() for p in model.parameters()):
            # FSDP2 shards parameters in the standard layout only (model.channels_last made them NHWC); the
            # values are the same, only the memory order changes
            model = model.to(memory_format=torch.contiguous_format)
        return self.shard(model)

    def shard(self, model: nn.Module, root: nn.Module | None = None) -> nn.Module:
        """fully_shard on each unit of `model` (shard_units), then on `root` (default: `model` itself; a pipeline
        stage's wrapper, whose forward the schedule calls); returns the root."""
        from torch.distributed.fsdp import fully_shard

        left: dict = {}  # what the dense units leave alone
        if self.experts is not None:  # the routed experts split over dist.ep: over their edp ranks first
            from ddpkit.parallel.experts.apply import shard_experts

            left = shard_experts(model, self.experts, self.shard_options())
        lean = self.memory == "lean"
        units = shard_units(model, parts=lean)
        for unit in units:  # one shard group per block (lean: per part of a block), then the root
            fully_shard(unit, **self.shard_options(), **left)
        root = model if root is None else root
        fully_shard(root, **self.shard_options(root=True), **left)
        if lean:
            for unit in units:
                # FSDP2's public way to turn off its implicit backward prefetch: an explicit list naming the
                # unit itself, which is gathered already when its backward starts, so nothing more is gathered
                unit.set_modules_to_backward_prefetch([unit])
            if self.ctx.device.type == "cpu":
                lean_heap()
        return root

    def unwrap(self, wrapped):
        return wrapped

    def eval_module(self, wrapped):
        return wrapped

    @property
    def collective_forward(self) -> bool:
        return True

    @contextlib.contextmanager
    def sync_context(self, wrapped, sync):
        wrapped.set_requires_gradient_sync(sync)
        yield
        if sync and self.experts is not None and not self.experts.shardable:  # experts FSDP2 left alone
            from ddpkit.parallel.experts.apply import reduce_expert_grads

            reduce_expert_grads(wrapped, self.experts)


def shard_units(model: nn.Module, parts: bool = False) -> list[nn.Module]:
    """The modules that get a shard group of their own: the model's repeated blocks (repeated_blocks: a
    transformer's layers, never called as a whole), its other parts (embeddings, final norm, head) left to the
    root's group, as torch's FSDP2 examples draw them: as separate units those small parts cost a gather and a
    reduce-scatter each per step (fsdp at 0.865x hand-written FSDP2 on gloo, 0.964x without them:
    benchmarks/RESULTS.md §16). A model with no blocks shards each top-level child that holds trainable
    parameters. A unit holding a parameter that a module outside it holds too (a token embedding tied to the
    head) is left to the root's group, which holds a shared parameter once for all the modules that use it.

    `parts` (dist.memory=lean): each block's children that hold a matrix (its attention, its MLP) are units of
    their own instead of the block, its norms left to the root's group; a block with one such child stays whole.
    A rank then holds one part gathered, with its unsharded gradients and their reduce-scatter buffer, instead of
    a whole block and the next one prefetched (benchmarks/RESULTS.md §11e)."""

    def trainable(m: nn.Module) -> bool:
        return any(p.requires_grad for p in m.parameters())

    units = [m for m in repeated_blocks(model) if trainable(m)]
    if not units:
        units = [m for m in model.children() if trainable(m)]
    holders: dict[int, set[int]] = {}  # parameter -> the modules holding it
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(m))

    def alone(unit: nn.Module) -> bool:
        inside = {id(m) for m in unit.modules()}
        return all(holders[id(p)] <= inside for p in unit.parameters())

    units = [m for m in units if alone(m)]
    return [p for m in units for p in _parts(m)] if parts else units


def _parts(block: nn.Module) -> list[nn.Module]:
    """A block's children holding a matrix (attention, MLP, experts), or the block when there are fewer than two."""
    kids = [c for c in block.children() if any(p.requires_grad and p.dim() >= 2 for p in c.parameters())]
    return kids if len(kids) > 1 else [block]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the modules of the classes its `_no_split_modules` names (transformers' declaration of
    its decoder layers), else the children of its outermost ModuleDicts / ModuleLists, at any depth (ddpkit's
    `blocks`, transformers' `model.layers`), a container among them opened in turn (nanoGPT's `transformer.h`);
    [] when there are none."""
    import torch.nn as nn

    containers = (nn.ModuleDict, nn.ModuleList)
    declared = getattr(model, "_no_split_modules", None) or ()
    names = {declared} if isinstance(declared, str) else set(declared)

    def outermost(wanted) -> list[nn.Module]:
        found: dict[int, nn.Module] = {}

        def visit(m: nn.Module) -> None:
            for c in m.children():
                if wanted(c):
                    found.setdefault(id(c), c)
                else:
                    visit(c)

        visit(model)
        return list(found.values())

    def opened(m: nn.Module) -> list[nn.Module]:
        return [b for c in m.children() for b in (opened(c) if isinstance(c, containers) else [c])]

    blocks = outermost(lambda m: type(m).__name__ in names) if names else []
    return blocks or [b for c in outermost(lambda m: isinstance(m, containers)) for b in opened(c)]


def _recognizes(model, optimizer) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


ENTRY = StrategyEntry(
    "fsdp",
    FSDPStrategy,
    "FSDP2, ZeRO-3: parameters, gradients and optimizer state sharded",
    shards=("optimizer", "gradients", "parameters"),
    remakes_optimizer=True,
    over_dtensors=True,
    offloads=True,
    with_pp=True,
    with_ep=True,
    auto=("offload",),
    recognizes=_recognizes,
    wraps_meta=True,
)
