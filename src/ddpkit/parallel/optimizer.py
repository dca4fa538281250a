"""A torch optimizer made again over other parameters (a strategy's sharded or wrapped ones): the same class,
the same parameter groups with their hyper-parameters, the same constructor switches (foreach, fused,
nesterov, ...), or a UserError naming what could not be kept.

One implementation for `ddpkit.prepare` (which re-makes the user's optimizer for zero1 / zero2 / fsdp / tp) and
for zero1's ZeroRedundancyOptimizer (which takes the class and its constructor's keyword arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ddpkit.errors import UserError, first_line

# what torch's optimizers keep in `defaults` that their constructor does not take or that the new one re-derives
_DERIVED = ("differentiable",)


def _named_arguments(cls: type) -> tuple[set[str], bool]:
    """(the keyword arguments cls() names, whether it takes any other): a subclass whose __init__ passes
    **kwargs on names its parents' too."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names - {"self", "params"}, False
        if klass is torch.optim.Optimizer:
            break
    return names - {"self", "params"}, True


def constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor takes (AdamW's defaults also hold
    `decoupled_weight_decay`, which AdamW() does not take: it sets it itself)."""
    names, _ = _named_arguments(type(optimizer))
    return {k: v for k, v in optimizer.defaults.items() if k in names and k not in _DERIVED}


def _name(optimizer: torch.optim.Optimizer) -> str:
    return type(optimizer).__name__


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except (TypeError, RuntimeError, ValueError):
        return a is b


def check_kept(old: torch.optim.Optimizer, new: torch.optim.Optimizer, where: str) -> None:
    """Every hyper-parameter of `old` is `new`'s (defaults and each group's): a UserError naming the first that
    is not."""
    for key, value in old.defaults.items():
        if key in _DERIVED:
            continue
        if key not in new.defaults or new.defaults[key] != value:
            raise UserError(
                f"{where}: {_name(old)}'s {key}={value!r} cannot be kept when it is made again "
                f"(it sets {key}={new.defaults.get(key)!r})",
                f"let its __init__ take {key}, or build the optimizer after prepare()",
            )
    for key, value in vars(old).items():  # a subclass's own settings (self.k = k), kept beside the groups
        if key.startswith("_") or key in ("defaults", "state", "param_groups") or callable(value):
            continue  # torch's own bookkeeping, and methods patched onto the instance (an LR scheduler's step)
        other = vars(new).get(key, _MISSING)
        if other is _MISSING or type(other) is not type(value) or not _same(value, other):
            raise UserError(
                f"{where}: {_name(old)}'s attribute {key}={value!r} cannot be kept when it is made "
                f"again (it sets {key}={None if other is _MISSING else other!r})",
                f"keep {key} in its defaults, or build the optimizer after prepare()",
            )
    for i, (a, b) in enumerate(zip(old.param_groups, new.param_groups, strict=True)):
        for key, value in a.items():
            if key != "params" and key not in _DERIVED and b.get(key) != value:
                raise UserError(
                    f"{where}: parameter group {i}'s {key}={value!r} is lost ({b.get(key)!r} when made again)",
                    "build the optimizer after prepare() from the model it returns",
                )


def rebuild_optimizer(
    old: torch.optim.Optimizer, params: Sequence[Sequence[torch.nn.Parameter]], where: str
) -> torch.optim.Optimizer:
    """`old`'s class made again over `params` (one list per parameter group of `old`, in its order): each group's
    hyper-parameters and the constructor's switches kept, or a UserError saying which cannot be (`where` begins
    the line: "ddpkit.prepare(strategy='fsdp')")."""
    if len(params) != len(old.param_groups):
        raise ValueError("one list of parameters per parameter group")
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(p)}
        for g, p in zip(old.param_groups, params, strict=True)
    ]
    try:
        new = type(old)(groups, **constructor_kwargs(old))
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(
            f"{where}: {_name(old)} cannot be made again over the prepared parameters: {first_line(e, 60)}",
            "drop that option, or build the optimizer after prepare()",
        ) from None
    check_kept(old, new, where)
    return new


__all__ = ["check_kept", "constructor_kwargs", "rebuild_optimizer"]
