"""The Trainer behind `ddpkit train` and what it stands on: the builders of its parts, the task (classification
or language model), the optimizer and its schedule, the training state, measured memory, the run directory and
its lock, metrics and logs, what the ranks agree on before they stop, and heartbeats.

Light to import: a module here imports torch only if it needs it.
"""
