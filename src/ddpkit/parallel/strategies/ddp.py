"""ddp: DistributedDataParallel, with an optional gradient-compression hook (torch's own DDP comm hooks). Under
expert parallelism DDP leaves the experts split over dist.ep alone (and every mixture of experts' per-rank routing
counts): their gradients are reduced over the ranks holding the same experts once the step's last backward is
done (parallel/experts/)."""

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

        from ddpkit.parallel.experts.apply import ignore_in_ddp

        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        ddp = DDP(ignore_in_ddp(model), device_ids=ids, process_group=self.dp_group, **self.ddp_options)
        self._hook_state = self.compression.register(ddp)
        return ddp

    def hook_state(self) -> dict | None:
        """The compression hook's state (PowerSGD's error feedback, warm-start factors, step, RNG) for a checkpoint."""
        return self.compression.state_dict(self._hook_state)

    def load_hook_state(self, state: dict | None) -> None:
        self.compression.load_state_dict(self._hook_state, state, self.ctx.device)

    @contextlib.contextmanager
    def sync_context(self, wrapped: nn.Module, sync: bool):
        with contextlib.nullcontext() if sync else wrapped.no_sync():
            yield
        if sync and self.experts is not None:  # the experts DDP left alone: over the ranks holding them
            from ddpkit.parallel.experts.apply import reduce_expert_grads

            reduce_expert_grads(wrapped.module, self.experts)


ENTRY = StrategyEntry(
    "ddp",
    DDPStrategy,
    "DistributedDataParallel: gradients all-reduced",
    ddp_knobs=True,
    compression=True,
    replicates=True,
    with_pp=True,
    with_ep=True,
    auto=("several",),
)
