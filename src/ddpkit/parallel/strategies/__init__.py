"""The built-in strategies, one module each; each registers its `StrategyEntry` when imported."""
