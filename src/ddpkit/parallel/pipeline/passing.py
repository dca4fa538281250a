"""What a pipeline stage passes on, checked as it runs: a stage gives the next one tensors (all that
torch.distributed.pipelining sends), and the last gives loss_fn a tensor. Unchecked, torch refuses from inside
its schedule (`PipeliningMetadataError: Stage arg[0] has type tuple`), naming neither the model nor the value;
here it is one UserError saying which stage gives what, where that value comes from, and what a stage needs.
torch's own refusals that still reach a step come out as one line too (`refusal`).

A stage may say where each value it gives comes from (`ddpkit_gives`: one phrase per value, pipeline.eager sets
it) and whose stage it is (`ddpkit_model`: the model's class name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.errors import UserError, first_line

NEEDS = "stages pass only tensors"


def described(value: Any) -> str:
    """`value` in a few words: 'a tuple of 2 tensors', 'a CausalLMOutputWithPast', 'None'."""
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        kinds = {type(v).__name__ for v in value}
        inner = "tensors" if kinds == {"Tensor"} else "values"
        return f"a {type(value).__name__} of {len(value)} {inner}"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def model_name(stage: nn.Module) -> str:
    return getattr(stage, "ddpkit_model", None) or type(stage).__name__


def check_output(out: Any, stage: nn.Module, index: int, n_stages: int) -> None:
    """UserError when stage `index` of `n_stages` gives what a pipeline cannot pass on (see the module)."""
    name = model_name(stage)
    if index == n_stages - 1:
        values = list(out) if isinstance(out, (tuple, list)) else [out]
        if values and all(isinstance(v, torch.Tensor) for v in values):
            return
        raise UserError(
            f"pipeline stage {index} of {name}, the last, gives loss_fn {described(out)}, not a tensor",
            "make the model's forward return a tensor: its logits (a transformers output's `.logits`)",
        )
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    sources = getattr(stage, "ddpkit_gives", None) or []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            continue
        source = f" ({sources[i]})" if i < len(sources) else ""
        raise UserError(
            f"pipeline stage {index} of {name} gives stage {index + 1} {described(value)} as its value {i}{source}; "
            f"{NEEDS}",
            "cut (pp_split) where only tensors cross, or compute it per stage",
        )


def checked_loss(loss_fn: Callable) -> Callable:
    """`loss_fn`, whose value is checked to be what the schedule's backward starts from: one number."""

    def loss(output: Any, target: Any) -> torch.Tensor:
        value = loss_fn(output, target)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shape = (
                f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else described(value)
            )
            raise UserError(
                f"the pipeline's loss_fn gave {shape}; a pipeline's backward starts from the mean loss, one number",
                "return the mean: e.g. F.cross_entropy(logits.flatten(0, 1), targets.flatten())",
            )
        return value

    return loss


def refusal(error: BaseException) -> BaseException | None:
    """What to raise for `error`, raised inside a pipeline schedule's step: the UserError behind it (a stage's
    check, under torch's RuntimeError), torch's PipeliningMetadataError as one UserError, or None (raise
    `error` itself: a fault in the model's own code keeps its traceback)."""
    seen = error
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        if type(seen).__name__ == "PipeliningMetadataError":
            return UserError(
                f"torch's pipeline refused what a stage passes: {first_line(seen, limit=80, joined=True)}",
                "give every step batches of one shape and dtype",
            )
        seen = seen.__cause__ or seen.__context__
    return None


__all__ = ["check_output", "checked_loss", "described", "refusal"]
