"""Save and load the whole training state of a user's script: model, optimizer, scheduler, scaler, the loader's
position, every rank's random streams and any values of the user's — one atomic file, loadable with
torch.load(weights_only=True).

    ddpkit.save_state("ckpt.pt", model=model, optimizer=opt, scheduler=sched, loader=train_loader, epoch=e)
    extra = ddpkit.load_state("ckpt.pt", model=model, optimizer=opt, scheduler=sched, loader=train_loader)

Both are collective: every rank calls them (the state of a sharded model or optimizer is gathered, every rank's
random streams are saved), rank 0 writes, and every rank loads the file onto its own device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint import load_checkpoint, save_checkpoint
from ddpkit.distributed.collectives import all_gather_object, barrier, get_rank, get_world_size
from ddpkit.distributed.runtime import current, init_distributed
from ddpkit.errors import UserError, first_line
from ddpkit.parallel.strategy import strategy_of
from ddpkit.porting.rng import rng_state, set_rng_state

FORMAT = "ddpkit.state/1"
STATEFUL = ("scheduler", "scaler", "loader")  # objects whose state_dict() save_state keeps
_PLAIN = (torch.Tensor, str, int, float, bool, type(None), torch.dtype, torch.device)


def _check_plain(value: Any, where: str) -> None:
    """Refuse, before anything is written, a value that torch.load(weights_only=True) could not read back."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, where)
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise UserError(
        f"save_state: {where} is a {type(value).__name__}, which a safe load (weights_only=True) cannot read back",
        "save tensors, numbers, strings, lists and dicts of them (e.g. a state_dict(), not the object)",
    )


def _strategy(model: nn.Module, optimizer: Any):
    """The Strategy that knows how to read and write this (prepared) model's and optimizer's full state."""
    return strategy_of(model, optimizer, current() or init_distributed())


def save_state(path: str | os.PathLike, *, model: nn.Module, optimizer: Any = None, **objects: Any) -> Path:
    """Write the training state to `path` atomically (rank 0 writes; every rank must call it).

    `objects`: `scheduler=`, `scaler=`, `loader=` (anything with state_dict()); every other keyword is a value of
    yours (numbers, strings, tensors, lists, dicts) that load_state returns.
    """
    extra = {k: v for k, v in objects.items() if k not in STATEFUL}
    _check_plain(extra, "extra")
    strategy = _strategy(model, optimizer)
    state: dict[str, Any] = {
        "format": FORMAT,
        "model": strategy.model_state(model),
        "world_size": get_world_size(),
    }
    if optimizer is not None:
        state["optimizer"] = strategy.optimizer_state(model, optimizer)
    for name in STATEFUL:
        if objects.get(name) is not None:
            state[name] = objects[name].state_dict()
    state["rng"] = all_gather_object(rng_state())
    state["extra"] = extra
    target = Path(path)
    if get_rank() == 0:
        save_checkpoint(state, target)
    barrier()  # nobody reads the file before it is complete
    return target


def load_state(
    path: str | os.PathLike, *, model: nn.Module, optimizer: Any = None, **objects: Any
) -> dict[str, Any]:
    """Restore what save_state wrote, on every rank; returns the extra values given to save_state.

    The random streams come back per rank when the world size is the one that saved them.
    """
    unknown = sorted(set(objects) - set(STATEFUL))
    if unknown:
        raise TypeError(
            f"load_state() got unexpected keyword(s) {unknown}; it restores {', '.join(STATEFUL)}"
        )
    state = load_checkpoint(path, map_location="cpu", require=("model",))
    if state.get("format") != FORMAT:
        raise UserError(f"'{path}' was not written by ddpkit.save_state", "give a file that save_state wrote")
    optim_sd = state.get("optimizer") if optimizer is not None else None
    try:
        _strategy(model, optimizer).load(model, optimizer, state["model"], optim_sd)
    except (RuntimeError, KeyError, ValueError) as e:
        raise UserError(
            f"'{path}' does not fit this model: {first_line(e, 100)}",
            "load it into the model it was saved from",
        ) from None
    unknown = sorted(set(objects) - set(STATEFUL))
    if unknown:
        raise TypeError(
            f"load_state() got unexpected keyword(s) {unknown}; it restores {', '.join(STATEFUL)}"
        )
    for name in STATEFUL:
        if objects.get(name) is not None and name in state:
            objects[name].load_state_dict(state[name])
    rng = state.get("rng") or []
    if len(rng) == get_world_size():
        set_rng_state(rng[get_rank()])
    return dict(state.get("extra") or {})
