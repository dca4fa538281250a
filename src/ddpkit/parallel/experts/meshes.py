"""The meshes of expert parallelism, borrowed from the dp dim of the ("pp", "dp", "tp") device mesh: dp = edp x ep
(the ep ranks next to each other). Under HSDP the dp dim is dp_replicate x dp_shard and ep divides dp_shard: the
experts' FSDP2 mesh is then ("dp_replicate", "edp_shard")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ExpertMeshes:
    """`ep`: the 1-D mesh of a rank's expert-parallel peers (the experts' DTensor mesh); `edp`: the mesh of the
    ranks holding the same experts (1-D, or 2-D (dp_replicate, edp_shard) under HSDP), over which the experts are
    data-parallel; `dp`: the dense data-parallel degree (what an expert's summed gradient is divided by);
    `exchange`: the process group of the ep peers' all-to-alls, a group of its own. (The mesh may hand the ep dim
    the group of the dp dim when they hold the same ranks; collectives on one group run in the order they are
    issued, and the order of the data-parallel reductions a backward issues between its all-to-alls differs from
    rank to rank with the tokens each expert got: on one group they would be taken for each other.)"""

    ep: Any
    edp: Any
    dp: int
    exchange: Any = None

    @property
    def shardable(self) -> bool:
        """FSDP2 has ranks to shard the experts over: the edp dim (under HSDP its sharding part) holds several.
        Otherwise (dist.ep takes every dp rank, or every rank of an HSDP sharding group) FSDP2 leaves the experts
        alone and reduce_expert_grads reduces them over `edp_group`."""
        return self.edp.size(self.edp.ndim - 1) > 1

    @property
    def edp_group(self) -> Any:
        """The process group of the ranks holding the same experts, over which their gradients are summed by hand
        (under ddp, or where they are not shardable: under HSDP the replicas); None for this rank alone."""
        dim = 0 if self.edp.ndim == 1 or not self.shardable else None
        if dim is None or self.edp.size(dim) == 1:
            return None
        return self.edp.get_group(dim)


def expert_meshes(mesh: Any, ep: int, dp_shard: int | None = None) -> ExpertMeshes:
    """ExpertMeshes of the ("pp", "dp", "tp") `mesh` for dist.ep=`ep` (`dp_shard`: HSDP's sharding group);
    collective."""
    dp = mesh["dp"].size()
    if dp_shard is None:
        split = mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep"))
        meshes = ExpertMeshes(split["ep"], split["edp"], dp)
    else:
        split = mesh._unflatten(
            "dp", (dp // dp_shard, dp_shard // ep, ep), ("dp_replicate", "edp_shard", "ep")
        )
        meshes = ExpertMeshes(split["ep"], split["dp_replicate", "edp_shard"], dp)
    meshes.exchange = _own_groups(mesh.mesh, ep)
    return meshes


def _own_groups(ranks: Any, ep: int) -> Any:
    """A new process group for each set of ep peers of the (pp, dp, tp) grid of global `ranks` (every rank makes
    every group, in one order); this rank's."""
    import torch.distributed as dist

    pp, dp, tp = ranks.shape
    mine = None
    for group in ranks.reshape(pp, dp // ep, ep, tp).permute(0, 1, 3, 2).reshape(-1, ep).tolist():
        made = dist.new_group(group)
        if dist.get_rank() in group:
            mine = made
    return mine
