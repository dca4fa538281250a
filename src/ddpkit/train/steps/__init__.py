"""The step runners: the one object the Trainer asks for an optimizer step's forward and backward, the exact
evaluation, what gradient clipping reaches and what a progress line shows (`StepRunner`, plain.py). build() asks
`build_runner` once; the first entry of `RUNNERS` that takes the config builds it: a pipeline's for dist.pp > 1
(pipeline.py: this rank's stages, the schedule feeding them, their checkpoints in full-model form), else the plain
one (one model wrapped by its strategy). A layout with a step of its own (experts, ...) is one module here and one
entry in `RUNNERS`; the Trainer holds no branch on the layout. What a model adds to the step of whatever layout
runs it (a mixture of experts' routing: experts.py) is an entry of `AROUND`, which wraps the layout's runner.

A runner counts what a step computed into the sums it is handed (the trainer's RunningSums) and gives back the
losses for the non-finite check; it reads nothing of the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ddpkit.train.steps import experts, pipeline, plain
from ddpkit.train.steps.plain import StepRunner

# (takes the config, builds the runner), asked in order
RUNNERS: tuple[tuple[Callable[[Any], bool], Callable[..., StepRunner]], ...] = (
    (pipeline.takes, pipeline.build),
    (lambda cfg: True, plain.build),
)
# (takes the config, wraps the layout's runner: (runner, cfg, ctx, **parts) -> runner), each that takes it in turn
AROUND: tuple[tuple[Callable[[Any], bool], Callable[..., Any]], ...] = ((experts.takes, experts.around),)


def build_runner(cfg: Any, ctx: Any, model: nn.Module, **parts: Any) -> StepRunner:
    """The runner of cfg's layout over `model` (split already by tensor parallelism and activation checkpointing):
    `parts` are the layout and mesh, the data's spec, the task, autocast, gradient scaler, device,
    train.grad_accum_steps and model.channels_last, and `make`: what makes a model built on the meta device once
    the runner has laid it out (parallel/materialize.py Materializer; None: the model has its values)."""
    build = next(build for takes, build in RUNNERS if takes(cfg))
    runner = build(cfg, ctx, model, **parts)
    for takes, around in AROUND:
        if takes(cfg):
            runner = around(runner, cfg, ctx, **parts)
    return runner


__all__ = ["AROUND", "RUNNERS", "StepRunner", "build_runner"]
