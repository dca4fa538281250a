"""dp: nn.DataParallel, one process, threads over the local GPUs (the tutorials' step 2)."""

from __future__ import annotations

from ddpkit.parallel.strategy import Strategy, StrategyEntry


class DataParallelStrategy(Strategy):
    name = "dp"

    def wrap(self, model):
        import torch
        import torch.nn as nn

        if self.ctx.device.type == "cuda" and torch.cuda.device_count() > 1:
            return nn.DataParallel(model)
        return model


ENTRY = StrategyEntry(
    "dp", DataParallelStrategy, "DataParallel in one process", one_process=True, needs_group=False
)
