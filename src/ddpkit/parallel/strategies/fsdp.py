"""fsdp: FSDP2 (fully_shard), ZeRO-3: parameters, gradients and optimizer state sharded over the ranks.

Over the "dp" dim of the device mesh when the model is split (tensor parallel: FSDP2 shards the DTensors
further); dist.offload=cpu keeps the shards, their gradients and the optimizer state in CPU memory
(CPUOffloadPolicy). The base Strategy gathers and scatters the full state of the DTensor parameters.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ddpkit.parallel.strategy import Strategy, StrategyEntry, register_strategy

if TYPE_CHECKING:
    import torch.nn as nn


class FSDPStrategy(Strategy):
    name = "fsdp"
    reshard_after_forward: bool | None = (
        None  # torch's default, ZeRO-3: gathered for forward and again for backward
    )

    def shard_options(self) -> dict:
        """fully_shard's keyword arguments (a subclass changes what is resharded or offloaded)."""
        options: dict = {}
        if self.reshard_after_forward is not None:
            options["reshard_after_forward"] = self.reshard_after_forward
        if self.dp_mesh is not None:
            options["mesh"] = self.dp_mesh
        if self.offload == "cpu":
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
        return options

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        options = self.shard_options()
        for child in _shard_units(model):
            fully_shard(child, **options)
        fully_shard(model, **options)
        return model

    def unwrap(self, wrapped):
        return wrapped

    def eval_module(self, wrapped):
        return wrapped

    @property
    def collective_forward(self) -> bool:
        return True

    def sync_context(self, wrapped, sync):
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """One shard group per top-level child with trainable parameters; a ModuleDict or ModuleList of blocks
    (the GPT's) gives one per block."""
    import torch.nn as nn

    units = []
    for child in model.children():
        if not any(p.requires_grad for p in child.parameters()):
            continue
        if isinstance(child, nn.ModuleDict | nn.ModuleList):
            units += [m for m in child.children() if any(p.requires_grad for p in m.parameters())]
        else:
            units.append(child)
    return units


def _recognizes(model, optimizer) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


ENTRY = register_strategy(
    StrategyEntry(
        "fsdp",
        FSDPStrategy,
        "FSDP2, ZeRO-3: parameters, gradients and optimizer state sharded",
        shards=("optimizer", "gradients", "parameters"),
        remakes_optimizer=True,
        over_dtensors=True,
        offloads=True,
        recognizes=_recognizes,
    )
)
