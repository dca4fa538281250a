"""The built-in strategies, one module each; each declares its `StrategyEntry` (`ENTRY`), which
the registry (parallel/strategy.py) registers when it is first asked."""
