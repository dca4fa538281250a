"""A model (or a pipeline stage of it) split over the ep ranks, and what the data-parallel strategies ask of it:
which modules FSDP2 shards over the edp ranks, which parameters and buffers DDP leaves alone, the experts'
gradients reduced by hand under DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.models.experts import GroupedExperts, MoE, moe_layers
from ddpkit.parallel.experts.dispatch import AllToAll
from ddpkit.parallel.experts.meshes import ExpertMeshes


def apply_expert_parallel(module: nn.Module, meshes: ExpertMeshes) -> nn.Module:
    """Each MoE block of `module` keeps this rank's n_experts / ep experts (every expert weight a DTensor split
    over the experts on the ep mesh; the ranks start from the same full weights) and exchanges its tokens over the
    ep group; in place."""
    import logging

    from torch.distributed.tensor import DTensor, Shard

    # DTensor warns at every gather of an expert weight sharded over edp and ep (a checkpoint's full state) that two
    # all-gathers run where one could: a cost note, on every rank; the layout is the user's choice
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ep, rank = meshes.ep.size(), meshes.ep.get_local_rank()
    for moe in moe_layers(module):
        per = moe.routing.n_experts // ep
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            mine = p.detach()[rank * per : (rank + 1) * per].clone()
            shard = DTensor.from_local(mine, meshes.ep, [Shard(0)], run_check=False)
            setattr(moe.experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        moe.exchange = AllToAll(meshes.exchange, ep)
    return module


def expert_modules(module: nn.Module) -> list[GroupedExperts]:
    """The routed experts of `module`'s MoE blocks (FSDP2 shards each over the edp ranks)."""
    return [m.experts for m in moe_layers(module)]


def ddp_ignored(module: nn.Module) -> list[str]:
    """What DDP must leave alone in `module`: the experts split over ep (each rank's own, reduced over the edp
    ranks: reduce_expert_grads) and each MoE block's own routing counts (each rank's tokens, never broadcast)."""
    names = []
    for prefix, m in module.named_modules():
        if isinstance(m, MoE):
            names += [f"{prefix}.{b}" for b in MoE.LOCAL_BUFFERS]
        if isinstance(m, GroupedExperts):
            names += [f"{prefix}.{n}" for n, p in m.named_parameters() if hasattr(p, "to_local")]
    return names


def ignore_in_ddp(module: nn.Module) -> nn.Module:
    """Mark `ddp_ignored` on `module` for the DDP that wraps it next; `module` returned."""
    from torch.nn.parallel import DistributedDataParallel

    names = ddp_ignored(module)
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return module


@torch.no_grad()
def reduce_expert_grads(module: nn.Module, meshes: ExpertMeshes) -> None:
    """Under DDP: each expert weight's gradient summed over the edp ranks that hold it and divided by dp (the
    dense gradients' mean over dp, for the parameters DDP leaves alone). Collective over the edp group."""
    group = meshes.edp_group
    for experts in expert_modules(module):
        for p in experts.parameters():
            if not hasattr(p, "to_local"):
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local()
            if group is not None:
                dist.all_reduce(local, group=group)
            local.div_(meshes.dp)


def shard_experts(module: nn.Module, meshes: ExpertMeshes, options: dict) -> dict:
    """FSDP2 on each routed-experts module over the edp mesh (`options`: fully_shard's, the mesh replaced), their
    gradients divided by dp, not by edp (FSDP2's default), as the dense ones. Where the edp ranks give nothing to
    shard over (ExpertMeshes.shardable) the experts are left out of FSDP2: reduce_expert_grads reduces them. Returns
    what the dense units' fully_shard takes besides its options (the parameters it leaves alone)."""
    from torch.distributed.fsdp import fully_shard

    if not meshes.shardable:
        return {"ignored_params": {p for m in expert_modules(module) for p in m.parameters()}}
    premul = "nccl" in str(
        dist.get_backend(meshes.exchange)
    )  # gloo has no pre-multiplied sum: FSDP2 then divides
    for experts in expert_modules(module):
        fully_shard(experts, **{**options, "mesh": meshes.edp})
        experts.set_gradient_divide_factor(float(meshes.dp))
        experts.set_force_sum_reduction_for_comms(not premul)
    return {}
