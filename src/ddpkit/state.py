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
from ddpkit.errors import UserError
from ddpkit.rng import rng_state, set_rng_state

FORMAT = "ddpkit.state/1"
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


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _is_zero(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state_dict of the user's module (gathered from the ranks when sharded). Collective for fsdp."""
    from ddpkit.porting import unwrap

    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return unwrap(model).state_dict()


def _optimizer_state(model: nn.Module, optimizer: Any) -> dict | None:
    """The full optimizer state on rank 0 (gathered when sharded). Collective for fsdp and zero1."""
    if _is_zero(optimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if get_rank() == 0 else None
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=opts)
    return optimizer.state_dict()


def save_state(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    loader: Any = None,
    **extra: Any,
) -> Path:
    """Write the training state to `path` atomically (rank 0 writes; every rank must call it)."""
    _check_plain(extra, "extra")
    state: dict[str, Any] = {"format": FORMAT, "model": _model_state(model), "world_size": get_world_size()}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
        if obj is not None:
            state[name] = obj.state_dict()
    state["rng"] = all_gather_object(rng_state())
    state["extra"] = extra
    target = Path(path)
    if get_rank() == 0:
        save_checkpoint(state, target)
    barrier()  # nobody reads the file before it is complete
    return target


def load_state(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    loader: Any = None,
) -> dict[str, Any]:
    """Restore what save_state wrote, on every rank; returns the extra values given to save_state.

    The random streams come back per rank when the world size is the one that saved them.
    """
    from ddpkit.porting import unwrap

    state = load_checkpoint(path, map_location="cpu", require=("model",))
    if state.get("format") != FORMAT:
        raise UserError(f"'{path}' was not written by ddpkit.save_state", "give a file that save_state wrote")
    try:
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
        else:
            unwrap(model).load_state_dict(state["model"])
    except (RuntimeError, KeyError, ValueError) as e:
        from ddpkit.errors import first_line

        raise UserError(
            f"'{path}' does not fit this model: {first_line(e)}", "load it into the model it was saved from"
        ) from None
    if optimizer is not None and state.get("optimizer") is not None:
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            opts = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=opts)
        else:
            optimizer.load_state_dict(state["optimizer"])
    for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
        if obj is not None and name in state:
            obj.load_state_dict(state[name])
    rng = state.get("rng") or []
    if len(rng) == get_world_size():
        set_rng_state(rng[get_rank()])
    return dict(state.get("extra") or {})
