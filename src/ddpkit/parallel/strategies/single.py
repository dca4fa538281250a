"""single: one process, the plain module."""

from ddpkit.parallel.strategy import Strategy, StrategyEntry

ENTRY = StrategyEntry(
    "single",
    Strategy,
    "one process, the plain module",
    one_process=True,
    needs_group=False,
    auto=("one",),
    wraps_meta=True,
)
