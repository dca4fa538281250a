"""`ddpkit.prepare` of a model that has no values yet: built on the meta device by the user, or by a function that
takes no argument, which prepare() calls under it. The model is laid out there (tensor parallel, FSDP2), and
each rank makes only its own shards (parallel/materialize.py), by the first of:

- the folder's values, for a model that `ddpkit.load_model` of a Hugging Face folder built on the meta device
  (models/loading.py values_of): each rank reads only the slices it holds;
- its model family's steps (ModelFamily.init_weights: ddpkit's GPT and Llama): the one-process build's draws
  replayed from torch.manual_seed(seed), the weights of `torch.manual_seed(seed); Model(...)` exactly;
- the model's own `init_weights()` (torchtitan's convention), called on the laid-out model after
  torch.manual_seed(seed): on a layout that splits a tensor its random ops are DTensor's, which equal the
  one-process draws only where DTensor's random generator makes them so (its offsets, on CUDA);
- each module's own `reset_parameters()` (every torch layer has one), replayed in the order the modules are
  registered from torch.manual_seed(seed): the weights of `torch.manual_seed(seed); Model()` on the CPU when its
  constructor draws nothing else (a model of torch layers with their default initialisation).

A model with tensors none of these makes is refused in one line naming the module.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.data.loaders import DistributedLoader
from ddpkit.errors import UserError
from ddpkit.models import family_of_module
from ddpkit.models.init import named_tensors
from ddpkit.models.loading import values_of
from ddpkit.parallel.materialize import Materializer, StreamReplay, on_meta


def _required(fn: Any) -> list[str]:
    """The arguments `fn` cannot be called without."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: not a builder of ours
        return ["?"]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


def is_builder(obj: Any) -> bool:
    """A function (or class) that takes no argument, given to prepare() in place of a model."""
    others = (
        nn.Module,
        torch.optim.Optimizer,
        DataLoader,
        DistributedLoader,
        torch.optim.lr_scheduler.LRScheduler,
    )
    return callable(obj) and not isinstance(obj, others) and not _required(obj)


def built(objects: Sequence[Any]) -> list[Any]:
    """`objects` with a function that takes no argument replaced by the model it builds on the meta device."""
    out = []
    for obj in objects:
        if not is_builder(obj):
            out.append(obj)
            continue
        with torch.device("meta"):
            model = obj()
        if not isinstance(model, nn.Module):
            raise UserError(
                f"ddpkit.prepare: {getattr(obj, '__name__', obj)!r} took no argument and returned "
                f"{type(model).__name__}, not a model (an nn.Module)",
                "pass a function that builds and returns the model (an nn.Module), or the model itself",
            )
        out.append(model)
    return out


class RootInit(Materializer):
    """The model's own init_weights(), called on the laid-out model after torch.manual_seed(seed)."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__(None, device)
        self.seed = seed

    def fill(self, modules: Sequence[nn.Module]) -> None:
        torch.manual_seed(self.seed)
        with torch.no_grad():
            for module in modules:
                module.init_weights()


def maker(model: nn.Module, seed: int, device: torch.device) -> Materializer | None:
    """What makes `model` once it is laid out (module docstring), None for a model that has its values already;
    a UserError naming a module whose tensors nothing makes."""
    if not on_meta(model):
        return None
    folder = values_of(model)  # ddpkit.load_model of a Hugging Face folder under torch.device("meta")
    if folder is not None:  # its values, each rank reading only the slices it holds
        return Materializer(folder, device)
    family = family_of_module(model)
    if family is not None and family.init_weights is not None:
        return Materializer(StreamReplay(model, family.init_weights, seed), device)
    init = getattr(model, "init_weights", None)
    if callable(init):
        if _required(init):
            raise UserError(
                f"ddpkit.prepare: {type(model).__name__}.init_weights() needs {', '.join(_required(init))}; "
                "prepare() calls it with no argument",
                "give those arguments defaults, or give each module a reset_parameters()",
            )
        return RootInit(seed, device)
    replay = StreamReplay(model, None, seed)
    unmade = replay.unmade()
    if unmade:
        owners = {name: owner for name, owner, _, _ in named_tensors(model)}
        owner = type(owners[unmade[0]]).__name__
        raise UserError(
            f"prepare: nothing makes the meta model's tensor {unmade[0]} ({owner} has no reset_parameters())",
            f"give {owner} a reset_parameters(), the model an init_weights(), or build it on the CPU",
        )
    return Materializer(replay, device)


__all__ = ["RootInit", "built", "is_builder", "maker"]
