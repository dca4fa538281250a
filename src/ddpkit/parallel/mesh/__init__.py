"""One device mesh for every parallel layout, its geometry only: pipeline x data x tensor; the modules beside it
split the model itself over the mesh (`tensor`: tensor parallelism; `activation`: activation checkpointing). Which
strategy runs over the mesh, and whether the model can be split over it, is decided above it (parallel/plan.py).

The ranks form a (pp, dp, tp) grid, tensor-parallel peers next to each other (rank = (pp_i * dp + dp_j) * tp +
tp_k), so a tensor-parallel group sits on one node whenever tp divides the processes per node. The data-parallel
degree is what is left: world_size / (tp * pp). Under HSDP (dist.strategy=hsdp) the dp dim is itself
dp_replicate x dp_shard (dp_j = r * dp_shard + s): FSDP shards over the dp_shard ranks next to each other (one
node by default) and replicates over the groups (`hsdp_mesh`). Expert parallelism (dist.ep) borrows its ranks
from the dp dim as torchtitan does: dp = edp x ep (dp_j = d * ep + e), the ep ranks next to each other (inside one
HSDP sharding group), each holding 1/ep of the routed experts and exchanging tokens with the others; the experts
are data-parallel over the edp ranks that hold the same ones (`expert_meshes`, parallel/experts/). Ranks of one
tensor or pipeline group read the same samples (the loaders shard by the dp coordinate and dp degree), and metrics
count every sample once, on one rank per dp replica (`counts`).

Importing this module imports no torch: the command line checks a layout before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "tp")  # the mesh's dimension names, outermost first


@dataclass(frozen=True)
class Layout:
    """How the ranks split: dp data-parallel replicas, each a pipeline of pp stages of tp tensor-parallel ranks."""

    dp: int
    tp: int = 1
    pp: int = 1
    dp_shard: int | None = None  # HSDP: ranks per sharding group (None: one group of all dp ranks)
    ep: int = 1  # expert-parallel ranks, borrowed from dp (dp_j = edp * ep + ep coordinate)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard(self) -> int:
        """Ranks per sharding group of the dp dim (all of it unless HSDP splits it)."""
        return self.dp_shard or self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k, "dp_replicate": r, "dp_shard": s, "ep": e, "edp": d} of `rank`, where rank =
        (i * dp + j) * tp + k, j = r * shard + s and j = d * ep + e."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        dp = (rank // self.tp) % self.dp
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": dp,
            "tp": rank % self.tp,
            "dp_replicate": dp // self.shard,
            "dp_shard": dp % self.shard,
            "ep": dp % self.ep,
            "edp": dp // self.ep,
        }

    def counts(self, rank: int) -> bool:
        """True on the one rank per dp replica whose sums the metrics count: tensor rank 0 of the last stage
        (tensor-parallel peers hold the same numbers, and only the last stage has the loss)."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def describe(self, rank: int) -> str:
        """`dp_replicate=0 dp_shard=1 dp=1 tp=0 pp=0` (this rank's coordinates, as `ddpkit info` shows them;
        dp = dp_replicate * shard + dp_shard)."""
        c = self.coords(rank)
        experts = f" ep={c['ep']}" if self.ep > 1 else ""
        return (
            f"dp_replicate={c['dp_replicate']} dp_shard={c['dp_shard']} dp={c['dp']} tp={c['tp']} pp={c['pp']}"
            + experts
        )

    @property
    def parallel(self) -> bool:
        """True when the model itself is split (tensor or pipeline parallel)."""
        return self.tp > 1 or self.pp > 1


def layout_of(world_size: int, tp: int = 1, pp: int = 1, dp_shard: int | None = None, ep: int = 1) -> Layout:
    """The Layout of `world_size` ranks with these degrees; a UserError when tp * pp does not divide it,
    dp_shard (HSDP's sharding group) the data-parallel degree, or ep the data-parallel ranks (HSDP's sharding
    group: the expert ranks sit inside one)."""
    if tp < 1 or pp < 1:
        raise UserError(
            f"dist.tp={tp} dist.pp={pp}: the degrees must be at least 1", "use dist.tp=1 dist.pp=1"
        )
    if world_size % (tp * pp):
        raise UserError(
            f"{world_size} process(es) cannot be split into dist.tp={tp} x dist.pp={pp}",
            f"start a multiple of {tp * pp} processes, or change dist.tp / dist.pp",
        )
    dp = world_size // (tp * pp)
    if dp_shard is not None and (dp_shard < 1 or dp % dp_shard):
        raise UserError(
            f"dist.dp_shard={dp_shard} does not divide the {dp} data-parallel rank(s) (dist.tp={tp} dist.pp={pp})",
            f"use a dist.dp_shard that divides {dp}",
        )
    check_ep(ep, dp, dp_shard, f"{world_size} process(es) with dist.tp={tp} dist.pp={pp}")
    return Layout(dp=dp, tp=tp, pp=pp, dp_shard=dp_shard, ep=ep)


def check_ep(ep: int, dp: int, shard: int | None, what: str) -> None:
    """dist.ep divides the data-parallel ranks it borrows (those of one HSDP sharding group: `shard`)."""
    if ep < 1:
        raise UserError(f"dist.ep={ep}: the degree must be at least 1", "use dist.ep=1")
    if dp % ep:
        raise UserError(
            f"dist.ep={ep} does not divide the {dp} data-parallel rank(s) of {what} (ep borrows its ranks)",
            f"use a dist.ep that divides {dp}",
        )
    if shard is not None and shard % ep:
        raise UserError(
            f"dist.ep={ep} does not divide HSDP's sharding group of dist.dp_shard={shard} ranks",
            f"use a dist.ep that divides {shard}, or a dist.dp_shard that is a multiple of {ep}",
        )


def shard_degree(configured: int | None, dp: int, tp: int, per_node: int) -> int:
    """HSDP's ranks per sharding group: dist.dp_shard, or by default the data-parallel ranks of one node
    (the processes per node over tp), all of dp when they are more."""
    if configured is not None:
        return configured
    shard = min(dp, max(1, per_node // tp))
    if dp % shard:
        raise UserError(
            f"dist.strategy=hsdp shards over the {shard} data-parallel rank(s) of a node by default, which do not "
            f"divide the {dp} data-parallel ranks",
            f"set dist.dp_shard to a divisor of {dp}",
        )
    return shard


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "tp") DeviceMesh of `layout` over the default process group (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)


def hsdp_mesh(mesh: DeviceMesh, dp_shard: int) -> DeviceMesh:
    """The 2-D ("dp_replicate", "dp_shard") mesh of `mesh`'s dp dim (HSDP: FSDP2 replicates over the first,
    shards over the second); collective."""
    dp = mesh["dp"].size()
    four = mesh._unflatten("dp", (dp // dp_shard, dp_shard), ("dp_replicate", "dp_shard"))
    return four["dp_replicate", "dp_shard"]


__all__ = ["DIMS", "Layout", "build_mesh", "hsdp_mesh", "layout_of", "shard_degree"]
