"""A model built on the meta device, made real once it is laid out: each rank allocates only what it holds (a
DTensor's local shard: FSDP2's, tensor parallelism's, both) and fills it from a `WeightSource`.

The values are those of the whole model, whatever the layout: a source gives (name, this rank's piece) for every
tensor a rank holds; `WeightSource.piece(name, like)` is the one function a source implements (`like`: the
tensor laid out, a DTensor's placements over its mesh), or `whole(name, like)` which the default slices.
`StreamReplay`, the one built in, is the one-process build's own random draws, replayed. The constructor of a
model on a real device draws from torch's global stream: each module's reset_parameters() in the order the
modules are registered, then its family's own steps (ModelFamily.init_weights). The replay seeds the stream as
the build does and takes the same draws in the same order on the meta model's shapes, one module's tensors at a
time, keeping of each tensor's last draw this rank's piece only: exactly the one-process weights, whatever the
layout, holding one module's tensors at most beside the shards. A Materializer without a source gives memory
only, for a reader that fills the laid-out model itself (model.init_from's folder, read by each rank's
`Strategy.load_sharded`).

When to make it (`wrap_made`): after a strategy's wrap when the wrap keeps the meta device (FSDP2's fully_shard,
the plain module: StrategyEntry.wraps_meta), before it otherwise (DDP broadcasts the weights as it wraps them).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ddpkit.errors import UserError
from ddpkit.models.init import Steps, named_tensors
from ddpkit.parallel.strategy import Strategy


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_piece(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole` as `like` (a DTensor: its placements over its mesh) holds it; no
    communication."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


class WeightSource:
    """Where a model built on the meta device takes its values."""

    def pieces(self, wanted: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's piece) of every tensor of `wanted` ({full name: the tensor, laid out})."""
        for name, like in wanted.items():
            yield name, self.piece(name, like)

    def piece(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the tensor `name` (default: sliced from `whole`)."""
        return local_piece(self.whole(name, like), like)

    def whole(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The whole value of the tensor `name` (`like`: it laid out; its shape is the whole one's)."""
        raise NotImplementedError


class StreamReplay(WeightSource):
    """The draws of the one-process build of `recipe` (the whole model on the meta device, before any layout),
    replayed from torch.manual_seed(seed): each module's reset_parameters() in registration order, then `steps`
    (its family's, or none). The global stream ends where the build leaves it."""

    def __init__(self, recipe: nn.Module, steps: Steps | None, seed: int):
        self.recipe, self.steps, self.seed = copy.deepcopy(recipe), steps, seed

    def draws(self) -> Iterator[tuple[list[tuple[torch.Tensor | None, torch.Tensor]], Any]]:
        """([(the recipe's tensor a draw fills, or None for one thrown away; its shape's tensor)], what fills
        fresh ones), in the build's order."""
        for _, module in self.recipe.named_modules():
            own = [
                (k, t) for k, t in [*module._parameters.items(), *module._buffers.items()] if t is not None
            ]
            reset = getattr(module, "reset_parameters", None)
            if own and callable(reset):
                yield [(t, t) for _, t in own], functools.partial(_reset_on, module, own)
        for name, t, fill in self.steps(self.recipe) if self.steps is not None else ():
            yield [(t if name is not None else None, t)], lambda fresh, fill=fill: fill(fresh[0])

    def unmade(self) -> list[str]:
        """The recipe's tensors that no draw makes (a module's own tensor its reset_parameters() does not set,
        or that has none)."""
        made = {id(t) for pairs, _ in self.draws() for t, _ in pairs if t is not None}
        return [name for name, _, _, t in named_tensors(self.recipe) if id(t) not in made]

    def pieces(self, wanted: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        names = {id(t): name for name, _, _, t in named_tensors(self.recipe)}
        draws = list(self.draws())
        last = {id(t): i for i, (pairs, _) in enumerate(draws) for t, _ in pairs if t is not None}
        unmade = [name for name in self.unmade() if name in wanted]
        if unmade:
            raise UserError(
                f"nothing makes the meta model's tensors {', '.join(unmade[:3])}",
                "give each one's module a reset_parameters() (or the family init_weights), or build on the CPU",
            )
        torch.manual_seed(self.seed)
        for i, (pairs, fill) in enumerate(draws):
            fresh = [torch.empty(like.shape, dtype=like.dtype) for _, like in pairs]
            with torch.no_grad():
                fill(fresh)
            for (t, _), value in zip(pairs, fresh, strict=True):
                name = names.get(id(t)) if t is not None else None
                if name in wanted and last[id(t)] == i:
                    yield name, local_piece(value, wanted[name])


def _reset_on(module: nn.Module, own: list[tuple[str, torch.Tensor]], fresh: list[torch.Tensor]) -> None:
    """module.reset_parameters() on `fresh` whole tensors in place of its own (put back after)."""
    slots = [module._parameters if k in module._parameters else module._buffers for k, _ in own]
    put = [
        nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        for (_, t), new in zip(own, fresh, strict=True)
    ]
    for (k, _), slot, given in zip(own, slots, put, strict=True):
        if given.is_floating_point():
            given.data.fill_(float("nan"))  # what reset_parameters() leaves unset shows
        slot[k] = given
    try:
        module.reset_parameters()
    finally:
        for (k, t), slot, given, new in zip(own, slots, put, fresh, strict=True):
            if slot[k] is not given:  # reset_parameters replaced the tensor: its values are the ones it left
                new.copy_(slot[k].detach())
            slot[k] = t
    for (k, _), new in zip(own, fresh, strict=True):
        if new.is_floating_point() and bool(new.isnan().any()):
            raise UserError(
                f"{type(module).__name__}.reset_parameters() leaves its tensor '{k}' unset on the meta device",
                f"make {type(module).__name__}.reset_parameters() set every tensor of its own, or build the "
                "model on the CPU",
            )


def allocate(modules: Iterable[nn.Module], device: torch.device) -> None:
    """Each module's tensors on the meta device given storage on `device` (a DTensor: its local shard only),
    uninitialised. Swapped in place, not replaced: a parameter shared by two modules (a tied head) stays one, and
    an optimizer made over the meta parameters holds the real ones."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for module in modules:
            module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


class Materializer:
    """Makes modules built on the meta device real: `make(*modules)` allocates their tensors on `device` (a
    DTensor's local shard only) and fills them from `source`; returns the first."""

    def __init__(self, source: WeightSource | None, device: torch.device | str):
        self.source, self.device = source, torch.device(device)

    def __call__(self, *modules: nn.Module) -> nn.Module:
        allocate(modules, self.device)
        self.fill(modules)
        return modules[0]

    def fill(self, modules: Sequence[nn.Module]) -> None:
        if self.source is None:  # memory only: what fills it comes later (model.init_from's folder)
            return
        wanted = {name: t for module in modules for name, _, _, t in named_tensors(module)}
        with torch.no_grad():
            for name, piece in self.source.pieces(wanted):
                local(wanted[name]).copy_(piece)


def on_meta(model: nn.Module) -> bool:
    """True when any of `model`'s parameters or buffers is on the meta device (it has no values yet)."""
    return any(t.is_meta for _, _, _, t in named_tensors(model))


def wrap_made(strategy: Strategy, model: nn.Module, make: Any = None) -> nn.Module:
    """strategy.wrap(model), `model` made real by `make` (a Materializer; None: it is real already): after the
    wrap when the strategy's wrap keeps the meta device (each rank makes its own shards only), before it
    otherwise."""
    if make is None:
        return strategy.wrap(model)
    if strategy.entry.wraps_meta:
        wrapped = strategy.wrap(model)
        make(model)
        return wrapped
    return strategy.wrap(make(model))


__all__ = [
    "Materializer",
    "allocate",
    "StreamReplay",
    "WeightSource",
    "local",
    "local_piece",
    "on_meta",
    "wrap_made",
]
