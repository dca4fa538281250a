"""hsdp: hybrid sharded data parallel, FSDP2 over a 2-D data-parallel mesh: parameters, gradients and optimizer
state sharded inside groups of dist.dp_shard ranks (default: the processes of one node), each group a replica of
the others (gradients all-reduced across the groups after the reduce-scatter inside them).

The collectives that move the most bytes (the all-gathers of every forward and backward) stay inside a node; only
one all-reduce of a shard's gradients per step crosses the network. Over the "dp" dim of the (pp, dp, tp) mesh,
with dist.tp and dist.pp as fsdp. Saved and loaded as fsdp's (save_state recognizes it as fsdp).
"""

from __future__ import annotations

from ddpkit.parallel.mesh import Layout, build_mesh, hsdp_mesh, shard_degree
from ddpkit.parallel.strategies.fsdp import FSDPStrategy
from ddpkit.parallel.strategy import StrategyEntry


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"
    dp_shard: int | None = None  # ranks per sharding group (None: the processes per node)
    _hsdp_mesh = None

    @property
    def dp_mesh(self):
        """The 2-D ("dp_replicate", "dp_shard") mesh of the data-parallel ranks (built once; collective)."""
        if self._hsdp_mesh is None:
            mesh = self.mesh
            if mesh is None:  # ddpkit.prepare without tp: every rank data-parallel
                mesh = build_mesh(Layout(dp=self.ctx.world_size), self.ctx.device.type)
            dp, tp = mesh["dp"].size(), mesh["tp"].size()
            shard = shard_degree(self.dp_shard, dp, tp, self.ctx.env.local_world_size)
            self._hsdp_mesh = hsdp_mesh(mesh, shard)
        return self._hsdp_mesh

    @property
    def dp_group(self):
        return self.mesh.get_group("dp") if self.mesh is not None else None


ENTRY = StrategyEntry(
    "hsdp",
    HSDPStrategy,
    "hybrid sharding: FSDP2 inside groups of dist.dp_shard ranks, replicated across the groups",
    shards=("optimizer", "gradients", "parameters"),
    remakes_optimizer=True,
    over_dtensors=True,
    with_pp=True,
    with_ep=True,
    hybrid=True,
    wraps_meta=True,
)
