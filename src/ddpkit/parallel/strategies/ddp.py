"""ddp: DistributedDataParallel, with an optional gradient-compression hook (torch's own DDP comm hooks)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ddpkit.parallel.compression import Compression
from ddpkit.parallel.strategy import Strategy, StrategyEntry

if TYPE_CHECKING:
    import torch.nn as nn

    from ddpkit.parallel.compression import Compression


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, ctx, ddp_options=None, compression: Compression | None = None):

        super().__init__(ctx, ddp_options, compression or Compression())
        self._hook_state = None

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, process_group=self.dp_group, **self.ddp_options)
        self._hook_state = self.compression.register(ddp)
        return ddp

    def hook_state(self) -> dict | None:
        """The compression hook's state (PowerSGD's error feedback, warm-start factors, step, RNG) for a checkpoint."""
        return self.compression.state_dict(self._hook_state)

    def load_hook_state(self, state: dict | None) -> None:
        self.compression.load_state_dict(self._hook_state, state, self.ctx.device)

    def sync_context(self, wrapped: nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else wrapped.no_sync()


ENTRY = StrategyEntry(
    "ddp",
    DDPStrategy,
    "DistributedDataParallel: gradients all-reduced",
    ddp_knobs=True,
    compression=True,
    replicates=True,
    with_pp=True,
    auto=("several",),
)
