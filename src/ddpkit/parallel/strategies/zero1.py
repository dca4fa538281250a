"""zero1: DDP plus ZeroRedundancyOptimizer: each rank keeps 1/N of the optimizer state."""

from __future__ import annotations

from ddpkit.parallel.strategies.ddp import DDPStrategy
from ddpkit.parallel.strategy import StrategyEntry


class Zero1Strategy(DDPStrategy):
    name = "zero1"

    def build_optimizer(self, model, factory):
        """The factory's optimizer as a ZeroRedundancyOptimizer: its class, its parameter groups with their
        hyper-parameters and its constructor's switches, each rank holding the state of its part."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from ddpkit.parallel.optimizer import check_kept, constructor_kwargs

        template = factory(model)
        zero = ZeroRedundancyOptimizer(
            [dict(g) for g in template.param_groups],
            optimizer_class=type(template),
            process_group=self.dp_group,
            **constructor_kwargs(template),
        )
        check_kept(template, zero.optim, f"dist.strategy={self.name}")
        return zero


def _recognizes(model, optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


ENTRY = StrategyEntry(
    "zero1",
    Zero1Strategy,
    "ddp with the optimizer state sharded by ZeroRedundancyOptimizer",
    shards=("optimizer",),
    remakes_optimizer=True,
    ddp_knobs=True,
    compression=True,
    replicates=True,
    recognizes=_recognizes,
)
