"""`ddpkit.clip_grad_norm_`: torch.nn.utils.clip_grad_norm_ for every layout ddpkit makes.

    loss.backward()
    ddpkit.clip_grad_norm_(model, 1.0)   # or model.parameters(); returns the total norm, the same on every rank
    optimizer.step()

The norm is that of all the model's gradients together, as one process would compute it: a plain or DDP model's
gradients as they are (DDP averaged them already), FSDP's sharded gradients and tensor-parallel ones (DTensors
of one or several meshes, beside plain tensors) each counted whole, a pipeline's stages summed over the
pipeline's ranks. torch.nn.utils.get_total_norm takes each group of gradients that share a mesh and placements;
clip_grads_with_norm_ scales them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def _parameters_and_group(model_or_parameters: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """(this rank's parameters, those its part of the norm counts: a parameter several pipeline ranks share on
    one of them only, the process group whose ranks hold the other parts of the model: a pipeline's stages;
    None when this rank's parameters are the whole model). A model that is only a part of the whole (a
    pipeline's, parallel/pipeline/) answers for itself: `grad_norm_parts()` gives the three."""
    target = model_or_parameters
    parts = getattr(target, "grad_norm_parts", None)
    if callable(parts):
        return parts()
    if isinstance(target, torch.Tensor):
        params = [target]
    elif isinstance(target, nn.Module):
        params = list(target.parameters())
    else:
        params = list(target)
    return params, params, None


def _group_key(g: torch.Tensor) -> Any:
    """Gradients that torch's foreach norm can take together: plain ones by device and dtype, DTensors by mesh and
    placements too."""
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        return ("dtensor", id(g.device_mesh), g.placements, g.device, g.dtype)
    return ("plain", g.device, g.dtype)


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A DTensor norm's value over its whole mesh (collective), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def total_norm(
    model_or_parameters: Any, norm_type: float = 2.0, *, foreach: bool | None = None
) -> torch.Tensor:
    """The norm of all the gradients of `model_or_parameters` together (see the module's docstring), a plain
    float32 tensor, the same on every rank. Collective when the model is sharded, split or a pipeline."""
    _, counted, group = _parameters_and_group(model_or_parameters)
    return _total(counted, group, float(norm_type), foreach)


def _total(params: list[torch.Tensor], group: Any, norm_type: float, foreach: bool | None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    norms = [
        _whole(torch.nn.utils.get_total_norm(gs, norm_type, foreach=foreach)).float()
        for gs in groups.values()
    ]
    device = grads[0].device if grads else torch.device("cpu")
    norms = [n.to(device) for n in norms]
    local = (
        torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if norms
        else torch.zeros((), dtype=torch.float32, device=device)
    )
    if group is None or dist.get_world_size(group) == 1:
        return local
    # the other stages' parts: a p-norm's p-th powers add up, the inf-norm is the largest
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).float()


def clip_grad_norm_(
    model_or_parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale the gradients of a model (plain, DDP, FSDP, tensor-parallel, a pipeline from prepare(pp=...)) or of
    an iterable of parameters so that their joint norm is at most `max_norm`; returns the norm before clipping,
    the same on every rank (torch.nn.utils.clip_grad_norm_'s arguments and result)."""
    params, counted, group = _parameters_and_group(model_or_parameters)
    norm = _total(counted, group, float(norm_type), foreach)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p)
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, norm.to(ps[0].grad.device), foreach=foreach)
    return norm


__all__ = ["clip_grad_norm_", "total_norm"]
