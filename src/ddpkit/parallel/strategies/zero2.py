"""zero2: FSDP2 with reshard_after_forward=False, ZeRO-2: gradients and optimizer state sharded, each rank's
parameters gathered once per step and kept from forward to backward (no second all-gather in backward).

Between steps only the shards stay: what a rank holds at rest is that of fsdp; at the peak of a step it holds
the whole parameters, as ddp and zero1 do. Saved and loaded as fsdp's (save_state recognizes it as fsdp).
"""

from __future__ import annotations

from ddpkit.parallel.strategies.fsdp import FSDPStrategy
from ddpkit.parallel.strategy import StrategyEntry


class Zero2Strategy(FSDPStrategy):
    name = "zero2"
    reshard_after_forward = False


ENTRY = StrategyEntry(
    "zero2",
    Zero2Strategy,
    "FSDP2 without resharding after forward, ZeRO-2: gradients and optimizer state sharded",
    shards=("optimizer", "gradients"),
    remakes_optimizer=True,
    over_dtensors=True,
    offloads=True,
    with_pp=True,
    with_ep=True,
    auto=("tp",),
    wraps_meta=True,
)
