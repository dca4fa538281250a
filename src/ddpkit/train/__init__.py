"""The Trainer behind `ddpkit train` and what it stands on: the builders of its parts, the optimizer and its
schedule, the training state, the run directory and its lock, metrics and logs, start-up timing,
what the ranks agree on before they stop, and heartbeats.

Light to import: a module here imports torch only if it needs it (startup.py never does).
"""
