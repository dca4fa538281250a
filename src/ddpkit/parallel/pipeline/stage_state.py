"""Full-model state of pipeline stages: each rank holds one or more stages (modules that keep the full model's
names for the parts they own; their parameters may be DTensors under tensor parallel), one optimizer over them.

The same formats as checkpoint/state_dict.py (full tensors under full-model names; the optimizer state keyed by
name, param_groups listing names) and as sharded.py (DCP tensors `model.NAME`, `optim.NAME.KEY`), so a pipeline
checkpoint loads into any other layout and the other way round. Every function is collective.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint import dcp_io
from ddpkit.checkpoint.sharded import MODEL, OPTIM, _dcp_load, _name_keyed, _optim_template, model_sd_names
from ddpkit.checkpoint.state_dict import (
    GROUPS,
    PARAMS,
    STATE,
    _merged_on_rank0,
    _union,
    _union_optim,
    check_unused,
)


def _full(value: Any) -> Any:
    """A DTensor's whole value (collective over its mesh), on the CPU; anything else as is."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor().detach().cpu()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _order(stages: list[nn.Module], optimizer: Any) -> list[str]:
    """The names of the optimizer's parameters in its own order (the ids of optimizer.state_dict())."""
    names = {id(p): n for stage in stages for n, p in stage.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g[PARAMS]]


def _named(stages: list[nn.Module], optimizer: Any, value=_full) -> dict:
    sd = optimizer.state_dict()
    order = _order(stages, optimizer)
    state = {order[i]: {k: value(v) for k, v in s.items()} for i, s in sorted(sd[STATE].items())}
    groups = [{**g, PARAMS: [order[i] for i in g[PARAMS]]} for g in sd[GROUPS]]
    return {STATE: state, GROUPS: groups}


def model_state(stages: list[nn.Module]) -> dict:
    """Every stage's entries merged on rank 0 (an empty dict elsewhere)."""
    local = {k: _full(v) for stage in stages for k, v in stage.state_dict().items()}
    return _merged_on_rank0(local, _union) or {}


def optimizer_state(stages: list[nn.Module], optimizer: Any) -> dict | None:
    """The optimizer state of every stage, keyed by full-model name, merged on rank 0 (None elsewhere)."""
    return _merged_on_rank0(_named(stages, optimizer), _union_optim)


def _placed(full: Any, like: Any) -> Any:
    """`full` as this rank holds `like`: a DTensor's local shard (cut locally, no communication)."""
    if isinstance(full, torch.Tensor) and hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return full


def load_optimizer(stages: list[nn.Module], optimizer: Any, optim_sd: dict) -> None:
    """A name-keyed optimizer state (full tensors) into this rank's optimizer: the entries of its parameters."""
    order = _order(stages, optimizer)
    params = [p for g in optimizer.param_groups for p in g[PARAMS]]
    state = {}
    for i, (name, p) in enumerate(zip(order, params, strict=True)):
        if name in optim_sd[STATE]:
            state[i] = {
                k: _placed(v, p) if torch.is_tensor(v) and v.dim() else v
                for k, v in optim_sd[STATE][name].items()
            }
    own = optimizer.state_dict()[GROUPS]
    saved = optim_sd[GROUPS] + [{}] * (len(own) - len(optim_sd[GROUPS]))
    groups = [{**s, **{PARAMS: g[PARAMS]}} for g, s in zip(own, saved, strict=False)]
    optimizer.load_state_dict({STATE: state, GROUPS: groups})


def load_state(stages: list[nn.Module], optimizer: Any, model_sd: dict, optim_sd: dict | None) -> None:
    """A full state, written under any layout, into this rank's stages (each takes the names it holds)."""
    check_unused([k for stage in stages for k in stage.state_dict()], model_sd)
    for stage in stages:
        own = stage.state_dict()
        missing = [k for k in own if k not in model_sd]
        if missing:
            raise KeyError(f"the checkpoint has no '{missing[0]}'")
        stage.load_state_dict({k: _placed(model_sd[k], v) for k, v in own.items()})
    if optimizer is not None and optim_sd is not None:
        load_optimizer(stages, optimizer, optim_sd)


# ------------------------------------------------------------------------------------------- sharded


def sharded_state(stages: list[nn.Module], optimizer: Any) -> tuple[dict[str, torch.Tensor], dict]:
    """(this rank's tensors for a DCP folder, the non-tensor optimizer entries with every rank's groups)."""
    tensors = {MODEL + k: v for stage in stages for k, v in stage.state_dict().items()}
    if optimizer is None:
        return tensors, {}
    named = _named(stages, optimizer, value=lambda v: v)
    values: dict[str, dict] = {}
    for name, entries in named[STATE].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM}{name}.{key}"] = value
            else:
                values.setdefault(name, {})[key] = value
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {STATE: {}, GROUPS: named[GROUPS]})
    return tensors, {"optimizer_groups": _union_optim(parts)[GROUPS], "optimizer_values": values}


def load_sharded(path: str | os.PathLike, stages: list[nn.Module], optimizer: Any, side: dict) -> None:
    """A DCP folder written under any layout into this rank's stages (each reads the parts it holds)."""
    template = {MODEL + k: v for stage in stages for k, v in stage.state_dict().items()}
    check_unused(model_sd_names(template), model_sd_names(dcp_io.tensor_entries(dcp_io.read_metadata(path))))
    _dcp_load(Path(path), template)
    for stage in stages:
        stage.load_state_dict({k: template[MODEL + k] for k in stage.state_dict()})
    if optimizer is None or "optimizer_groups" not in side:
        return
    names = {n for stage in stages for n, _ in stage.named_parameters()}
    tensors = _optim_template(dcp_io.read_metadata(path), names)
    _dcp_load(Path(path), tensors)
    load_optimizer(stages, optimizer, _name_keyed(tensors, side, names))
