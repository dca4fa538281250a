"""fsdp: FSDP2 (fully_shard), ZeRO-3: parameters, gradients and optimizer state sharded over the ranks."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ddpkit.parallel.strategy import Strategy, StrategyEntry, register_strategy

if TYPE_CHECKING:
    import torch.nn as nn


class FSDPStrategy(Strategy):
    name = "fsdp"

    def shard_options(self) -> dict:
        """fully_shard's keyword arguments (a subclass changes what is resharded or offloaded)."""
        return {}

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        options = self.shard_options()
        for child in model.children():  # one shard group per top-level block, then the root
            if any(p.requires_grad for p in child.parameters()):
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
        recognizes=_recognizes,
    )
)
