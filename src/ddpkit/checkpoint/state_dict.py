"""Model and optimizer state under the full model's parameter names, whatever the layout.

One format for every layout (plain, DDP, ZeRO-1, FSDP2/zero2, DTensor tensor parallel, pipeline stages): the
model's `state_dict` under the user's module names with full tensors, and the optimizer's state keyed by those
names (torch.distributed.checkpoint.state_dict's format: `{"state": {name: {...}}, "param_groups": [{...,
"params": [names]}]}`), so a checkpoint written under one layout loads into any other. Pipeline stages keep the
full model's names for the parts they own; their states are merged on rank 0 and each stage takes its part back.

Every function is collective when a process group exists: every rank calls it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


# ------------------------------------------------------------------------------------------- the layout


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_unused(held: Iterable[str], saved: Iterable[str]) -> None:
    """KeyError naming the saved model tensors that no rank's model holds: a checkpoint of another model is
    refused, its extra tensors never dropped. The names are gathered from every rank (a pipeline stage holds
    some): collective when a group runs."""
    names = set(held)
    if _grouped():
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, sorted(names))
        names = names.union(*map(set, found))
    extra = sorted(set(saved) - names)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        # the first words say it all: a caller may keep only the start of the line
        raise KeyError(f"this model does not have the checkpoint's {extra[0]}{more}")


def has_dtensor(module: nn.Module) -> bool:
    """True when some parameter is a DTensor (FSDP2, zero2, tensor parallel): its full value needs gathering."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _is_zero(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def stages_differ(module: nn.Module) -> bool:
    """True when the ranks hold different parts of the model (pipeline stages). Collective."""
    if not _grouped():
        return False
    mine = tuple(sorted(module.state_dict().keys()))  # names, not hash(): that differs between processes
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return len(set(found)) > 1


def _options(full: bool, rank0_only: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=rank0_only)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _merged_on_rank0(part: dict, merge) -> dict | None:
    """Every rank's `part` merged with `merge(list of parts)` on rank 0 (None elsewhere)."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_to_cpu(part), parts, dst=0)
    return merge(parts) if parts is not None else None


def _union(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def _union_optim(parts: list[dict]) -> dict:
    """Name-keyed optimizer states of the stages as one: states side by side, each group's names joined."""
    groups: list[dict] = []
    for part in parts:
        for i, group in enumerate(part[GROUPS]):
            if i == len(groups):
                groups.append({**group, PARAMS: []})
            groups[i][PARAMS] += [n for n in group[PARAMS] if n not in groups[i][PARAMS]]
    return {STATE: _union([p[STATE] for p in parts]), GROUPS: groups}


# ------------------------------------------------------------------------------------ full: save


def model_state(module: nn.Module) -> dict:
    """The full model state on rank 0 (an empty dict elsewhere when it had to be gathered; the whole state on
    every rank when nothing had to be: plain, DDP, ZeRO-1)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if stages_differ(module):
        part = get_model_state_dict(module, options=_options(full=True))
        return _merged_on_rank0(part, _union) or {}
    if not has_dtensor(module):
        return module.state_dict()
    return get_model_state_dict(module, options=_options(full=True, rank0_only=True))


def _zero_names(module: nn.Module, optimizer: Any) -> list[str]:
    """The names of ZeroRedundancyOptimizer's parameters in its global order (the ids its state_dict uses)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group[PARAMS]]


def named_groups(module: nn.Module, optimizer: Any) -> list[dict]:
    """The optimizer's param_groups with parameter names in place of the parameters."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [{**g, PARAMS: [names[id(p)] for p in g[PARAMS]]} for g in optimizer.param_groups]


def _named_from_ids(sd: dict, names: list[str]) -> dict:
    groups = [{**g, PARAMS: [names[i] for i in g[PARAMS]]} for g in sd[GROUPS]]
    return {STATE: {names[i]: v for i, v in sd[STATE].items()}, GROUPS: groups}


def optimizer_state(module: nn.Module, optimizer: Any) -> dict | None:
    """The full optimizer state keyed by parameter name, on rank 0 (on every rank when nothing was gathered)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if _is_zero(optimizer):
        optimizer.consolidate_state_dict(to=0)
        if dist.get_rank() != 0:
            return None
        return _named_from_ids(optimizer.state_dict(), _zero_names(module, optimizer))
    if stages_differ(module):
        part = get_optimizer_state_dict(module, optimizer, options=_options(full=True))
        return _merged_on_rank0(part, _union_optim)
    if not has_dtensor(module):
        return get_optimizer_state_dict(module, optimizer, options=_options(full=False))
    sd = get_optimizer_state_dict(module, optimizer, options=_options(full=True, rank0_only=True))
    return sd if dist.get_rank() == 0 else None


# ------------------------------------------------------------------------------------ full: load


def is_name_keyed(optim_sd: dict) -> bool:
    """False for an optimizer state keyed by position (optimizer.state_dict(), older checkpoints)."""
    return all(isinstance(n, str) for g in optim_sd.get(GROUPS, []) for n in g.get(PARAMS, []))


def own_part(module: nn.Module, model_sd: dict, optim_sd: dict | None, partial: bool):
    """The entries of a full state that this module holds (a pipeline stage holds some of the names)."""
    if (
        not partial
    ):  # copies of the structure: torch's loaders put shards in place of the tensors they are given
        model_sd = dict(model_sd)
        if optim_sd is not None and is_name_keyed(optim_sd):
            optim_sd = {STATE: {k: dict(v) for k, v in optim_sd[STATE].items()}, GROUPS: optim_sd[GROUPS]}
        return model_sd, optim_sd
    names = set(module.state_dict().keys())
    check_unused(names, model_sd)
    model_sd = {k: v for k, v in model_sd.items() if k in names}
    if optim_sd is not None and is_name_keyed(optim_sd):
        params = {n for n, _ in module.named_parameters()}
        groups = [{**g, PARAMS: [n for n in g[PARAMS] if n in params]} for g in optim_sd[GROUPS]]
        optim_sd = {STATE: {k: v for k, v in optim_sd[STATE].items() if k in params}, GROUPS: groups}
    return model_sd, optim_sd


def _ids_from_named(module: nn.Module, optimizer: Any, sd: dict) -> dict:
    names = _zero_names(module, optimizer)
    index = {n: i for i, n in enumerate(names)}
    groups, start = [], 0
    for mine, saved in zip(optimizer.param_groups, sd[GROUPS], strict=True):
        ids = list(range(start, start + len(mine[PARAMS])))
        start += len(ids)
        groups.append({**saved, PARAMS: ids})
    state = {index[n]: v for n, v in sd[STATE].items()}
    return {STATE: state, GROUPS: groups}


def load_optimizer(module: nn.Module, optimizer: Any, optim_sd: dict, full: bool = True) -> None:
    """A name-keyed optimizer state (full tensors, or this layout's shards with full=False) into `optimizer`;
    a position-keyed one (older checkpoints) goes to optimizer.load_state_dict as it is."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not is_name_keyed(optim_sd):
        optimizer.load_state_dict(optim_sd)
    elif _is_zero(optimizer):
        optimizer.load_state_dict(_ids_from_named(module, optimizer, optim_sd))
    elif not optim_sd[
        STATE
    ]:  # no state of any parameter (SGD without momentum): torch's loader, which places
        # the state by its tensors' device, fails on none; the groups' settings are all there is
        own = optimizer.state_dict()[GROUPS]
        groups = [{**saved, PARAMS: g[PARAMS]} for g, saved in zip(own, optim_sd[GROUPS], strict=True)]
        optimizer.load_state_dict({STATE: {}, GROUPS: groups})
    else:
        set_optimizer_state_dict(module, optimizer, optim_sd, options=_options(full=full))


def load_state(module: nn.Module, optimizer: Any, model_sd: dict, optim_sd: dict | None) -> None:
    """A full model (and optimizer) state, from any layout, into this one. Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model_sd, optim_sd = own_part(module, model_sd, optim_sd, partial=stages_differ(module))
    if has_dtensor(module):
        set_model_state_dict(module, model_sd, options=_options(full=True))
    else:
        module.load_state_dict(model_sd)
    if optimizer is not None and optim_sd is not None:
        load_optimizer(module, optimizer, optim_sd)
