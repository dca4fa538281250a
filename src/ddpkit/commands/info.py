"""`ddpkit info`: who every rank is, printed by rank 0 in rank order."""

from __future__ import annotations

from ddpkit.cluster import netif
from ddpkit.distributed.collectives import gather_object_to
from ddpkit.distributed.runtime import DistContext, hostname
from ddpkit.launcher.warm_start import EVERY_WORKER
from ddpkit.parallel.mesh import layout_of, shard_degree
from ddpkit.parallel.strategy import get_strategy


def rank_line(ctx: DistContext, tp: int = 1, pp: int = 1, dp_shard: int | None = None) -> str:
    """This rank's line: who it is, where it runs, the interface and address its process group uses, and its
    coordinates in the dist.tp x dist.pp layout (dp= tp= pp=, and dp_replicate= dp_shard= of the dp dim split
    into HSDP's sharding groups of `dp_shard` ranks; None: one group)."""
    e = ctx.env
    master = e.init_method if e.init_method.startswith("file://") else f"{e.master_addr}:{e.master_port}"
    return (
        f"rank={e.rank} local_rank={e.local_rank} world_size={e.world_size} host={hostname()} "
        f"backend={ctx.backend} device={ctx.device} node_rank={e.node_rank} launcher={e.launcher} "
        f"master={master} {netif.current().describe()} {layout_of(e.world_size, tp, pp, dp_shard).describe(e.rank)}"
    )


def preload(cfg) -> list[str]:
    """The modules every worker imports (imported once by the launch's fork server: cli.py)."""
    return [*EVERY_WORKER, __name__, "ddpkit.parallel.mesh"]


def info_command(cfg, args, ctx: DistContext) -> int:

    d = cfg.dist
    shard = d.dp_shard
    if (
        d.strategy != "auto" and get_strategy(d.strategy).hybrid
    ):  # by default the data-parallel ranks of a node
        shard = shard_degree(shard, layout_of(ctx.world_size, d.tp, d.pp).dp, d.tp, ctx.env.local_world_size)
    lines = gather_object_to(rank_line(ctx, d.tp, d.pp, shard))
    if lines is not None:
        print("\n".join(lines), flush=True)
    return 0
