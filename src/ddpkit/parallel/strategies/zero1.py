"""zero1: DDP plus ZeroRedundancyOptimizer: each rank keeps 1/N of the optimizer state."""

from __future__ import annotations

from ddpkit.parallel.strategies.ddp import DDPStrategy
from ddpkit.parallel.strategy import StrategyEntry, register_strategy


class Zero1Strategy(DDPStrategy):
    name = "zero1"

    def build_optimizer(self, model, factory):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        template = factory(model)
        return ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=type(template),
            process_group=self.dp_group,
            **constructor_defaults(template),
        )


def constructor_defaults(optimizer) -> dict:
    """The optimizer's hyper-parameters that its class's constructor takes (AdamW's defaults also hold
    `decoupled_weight_decay`, which AdamW() refuses), less the implementation switches."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    skip = ("differentiable", "foreach", "fused")
    return {k: v for k, v in optimizer.defaults.items() if k in takes and k not in skip}


def _recognizes(model, optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


ENTRY = register_strategy(
    StrategyEntry(
        "zero1",
        Zero1Strategy,
        "ddp with the optimizer state sharded (ZeroRedundancyOptimizer)",
        shards=("optimizer",),
        remakes_optimizer=True,
        ddp_knobs=True,
        compression=True,
        recognizes=_recognizes,
    )
)
