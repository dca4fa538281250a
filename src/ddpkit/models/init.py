"""A model's initial weights as the steps that draw them (`ModelFamily.init_weights`): after each of its modules'
own `reset_parameters()` (which their constructors call, in the order the modules are registered), the steps its
constructor takes, each filling one whole tensor from torch's global random stream. A constructor on a real device
takes the steps in place (`init_tensors`); a model built on the meta device is made by replaying the same draws one
tensor at a time, each rank keeping only its own shards (parallel/materialize.py `StreamReplay`): the weights of the
one-process build, exactly, on any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

# (the tensor's full name, or None for a draw whose tensor the constructor then replaced (a head tied to the
# embedding); the tensor (its shape and dtype); what fills a whole tensor of that shape in place)
Step = tuple["str | None", torch.Tensor, Callable[[torch.Tensor], object]]
Steps = Callable[[nn.Module], Iterable[Step]]


def named_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """(full name, owning module, attribute, tensor) of every parameter and buffer of `module`, module by module
    in registration order (each module's own parameters, then its own buffers), a shared one once, under its
    first name."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for attr, t in [*owner._parameters.items(), *owner._buffers.items()]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield (f"{prefix}.{attr}" if prefix else attr), owner, attr, t


def post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of `module` and everything under it, children first: the order of nn.Module.apply."""
    for name, child in module.named_children():
        yield from post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def normal(std: float) -> Callable[[torch.Tensor], object]:
    """Fills a tensor with normal(0, std) draws."""
    return lambda t: t.normal_(0.0, std)


def zeros(t: torch.Tensor) -> object:
    return t.zero_()


def init_tensors(model: nn.Module, steps: Steps) -> None:
    """`steps` taken in place on `model` (its constructor's initialisation), drawing from torch's global stream;
    nothing on the meta device (replayed when the model is made: parallel/materialize.py)."""
    if any(t.is_meta for _, _, _, t in named_tensors(model)):
        return
    with torch.no_grad():
        for name, t, fill in steps(model):
            fill(t if name is not None else torch.empty_like(t))


__all__ = ["Step", "Steps", "init_tensors", "named_tensors", "normal", "post_order", "zeros"]
