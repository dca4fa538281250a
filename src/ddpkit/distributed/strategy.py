"""Moved to ddpkit.parallel: the strategy registry (ddpkit.parallel.strategy) and one module per strategy
(ddpkit.parallel.strategies). These names stay importable from here."""

from ddpkit.parallel.strategies.ddp import DDPStrategy
from ddpkit.parallel.strategies.dp import DataParallelStrategy
from ddpkit.parallel.strategies.fsdp import FSDPStrategy
from ddpkit.parallel.strategies.zero1 import Zero1Strategy
from ddpkit.parallel.strategy import (
    Strategy,
    build_strategy,
    ddp_options,
    resolve_strategy,
    unwrap_module,
)

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "FSDPStrategy",
    "Strategy",
    "Zero1Strategy",
    "build_strategy",
    "ddp_options",
    "resolve_strategy",
    "unwrap_module",
]
