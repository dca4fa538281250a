"""One device mesh for every parallel layout: pipeline x data x tensor; the modules beside it split the model
itself over the mesh (`tensor`: tensor parallelism; `activation`: activation checkpointing).

The ranks form a (pp, dp, tp) grid, tensor-parallel peers next to each other (rank = (pp_i * dp + dp_j) * tp +
tp_k), so a tensor-parallel group sits on one node whenever tp divides the processes per node. The data-parallel
degree is what is left: world_size / (tp * pp). Under HSDP (dist.strategy=hsdp) the dp dim is itself
dp_replicate x dp_shard (dp_j = r * dp_shard + s): FSDP shards over the dp_shard ranks next to each other (one
node by default) and replicates over the groups (`hsdp_mesh`). Ranks of one tensor or pipeline group read the same samples (the
loaders shard by the dp coordinate and dp degree), and metrics count every sample once, on one rank per dp
replica (`counts`).

Importing this module imports no torch: the command line checks a layout before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard(self) -> int:
        """Ranks per sharding group of the dp dim (all of it unless HSDP splits it)."""
        return self.dp_shard or self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k, "dp_replicate": r, "dp_shard": s} of `rank`, where rank = (i * dp + j) *
        tp + k and j = r * shard + s."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        dp = (rank // self.tp) % self.dp
        return {
            "pp": rank // (self.dp * self.tp),
            "dp": dp,
            "tp": rank % self.tp,
            "dp_replicate": dp // self.shard,
            "dp_shard": dp % self.shard,
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
        return f"dp_replicate={c['dp_replicate']} dp_shard={c['dp_shard']} dp={c['dp']} tp={c['tp']} pp={c['pp']}"

    @property
    def parallel(self) -> bool:
        """True when the model itself is split (tensor or pipeline parallel)."""
        return self.tp > 1 or self.pp > 1


def layout_of(world_size: int, tp: int = 1, pp: int = 1, dp_shard: int | None = None) -> Layout:
    """The Layout of `world_size` ranks with these degrees; a UserError when tp * pp does not divide it, or
    dp_shard (HSDP's sharding group) the data-parallel degree."""
    if tp < 1 or pp < 1:
        raise UserError(
            f"dist.tp={tp} dist.pp={pp}: the degrees must be at least 1", "use dist.tp=1 dist.pp=1"
        )
    if world_size % (tp * pp):
        raise UserError(
            f"{world_size} process(es) cannot be split into dist.tp={tp} x dist.pp={pp} "
            f"(world size must be a multiple of {tp * pp})",
            f"start a multiple of {tp * pp} processes, or change dist.tp / dist.pp",
        )
    dp = world_size // (tp * pp)
    if dp_shard is not None and (dp_shard < 1 or dp % dp_shard):
        raise UserError(
            f"dist.dp_shard={dp_shard} does not divide the {dp} data-parallel rank(s) of {world_size} process(es) "
            f"with dist.tp={tp} dist.pp={pp}",
            f"use a dist.dp_shard that divides {dp}",
        )
    return Layout(dp=dp, tp=tp, pp=pp, dp_shard=dp_shard)


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


# ------------------------------------------------------------------------------------- checks of a config

AUTO_OVER_TP = "zero2"  # dist.strategy=auto over the dp dim of a tensor-parallel model
AUTO_OFFLOAD = "fsdp"  # dist.strategy=auto with dist.offload=cpu


def _names(flag: str) -> str:
    """`zero2 or fsdp`: the registered strategies whose entry has `flag`."""
    from ddpkit.parallel.strategy import get_strategy, strategy_names

    names = [n for n in strategy_names() if getattr(get_strategy(n), flag)]
    return " or ".join(names)


def strategy_over_dp(name: str, layout: Layout, offload: str = "none") -> str:
    """The strategy that runs over the dp dim of `layout` for dist.strategy=`name` (auto resolved); a UserError
    for a combination torch cannot do."""
    from ddpkit.parallel.strategy import get_strategy, resolve_strategy

    if offload == "cpu":
        name = AUTO_OFFLOAD if name == "auto" else name
        if not get_strategy(name).offloads:
            raise UserError(
                f"dist.offload=cpu needs a strategy that shards with FSDP2 ({_names('offloads')}), not {name}",
                f"use dist.strategy={AUTO_OFFLOAD}, or dist.offload=none",
            )
        if layout.dp == 1:
            raise UserError(
                "dist.offload=cpu needs several data-parallel processes (FSDP2 shards over them)",
                "start more processes (e.g. --nproc-per-node 2), or use dist.offload=none",
            )
    if name == "auto" and layout.tp > 1 and layout.dp > 1:
        return AUTO_OVER_TP
    if layout.parallel and name not in ("auto", "single") and get_strategy(name).one_process:
        raise UserError(  # it would silently run as single: a process per rank is not one process
            f"dist.strategy={name} runs one process, not the {layout.tp * layout.pp} ranks of "
            f"dist.tp={layout.tp} dist.pp={layout.pp}",
            "use dist.strategy=auto",
        )
    if layout.dp == 1 and layout.parallel and name != "auto" and get_strategy(name).one_process:
        return "single"  # nothing to do over one data-parallel replica
    resolved = resolve_strategy(name, layout.dp)
    if layout.tp > 1 and resolved != "single" and not get_strategy(resolved).over_dtensors:
        raise UserError(
            f"dist.strategy={resolved} cannot run over tensor-parallel (DTensor) parameters (dist.tp={layout.tp})",
            f"use dist.strategy=auto ({AUTO_OVER_TP} over the data-parallel ranks), or {_names('over_dtensors')}",
        )
    return resolved


def check_model(cfg: Any, layout: Layout, backend: str | None = None) -> None:
    """The model's family can split it as asked: it declares a tensor-parallel plan (its sizes divisible by tp,
    and the sequence too where sequence parallelism splits it: a whole model over `backend`, see
    models.blocks.sequence_parallel_pays) and the blocks activation checkpointing re-computes."""
    from ddpkit.models import model_family  # imported here: this module imports no torch
    from ddpkit.models.blocks import sequence_parallel_pays

    m, tp = cfg.model, layout.tp
    family = model_family(m.arch)
    if tp > 1 and family.tp_plan is None:
        raise UserError(
            f"dist.tp={tp} needs a model with a tensor-parallel plan; model.arch={m.arch} has none",
            "pick a model.arch whose family declares one (ModelFamily.tp_plan), or "
            "ddpkit.prepare(model, tp=..., tp_plan=...) with a plan of your own",
        )
    sizes = family.tp_sizes(cfg) if tp > 1 else []
    if tp > 1 and layout.pp == 1 and sequence_parallel_pays(backend):
        sizes += family.sp_sizes(cfg)
    for key, value in sizes:
        if value % tp:
            raise UserError(
                f"{key}={value} cannot be split over dist.tp={tp} ranks (it must be a multiple of {tp})",
                f"use a {key} that is a multiple of {tp}, or another dist.tp",
            )
    if getattr(m, "tie_embeddings", False) and (tp > 1 or layout.pp > 1):
        raise UserError(
            f"model.tie_embeddings=true is not supported with dist.tp={tp} dist.pp={layout.pp}",
            "set model.tie_embeddings=false, or train without tensor and pipeline parallelism",
        )
    if m.activation_checkpointing != "none" and family.checkpointed is None:
        raise UserError(
            f"model.activation_checkpointing={m.activation_checkpointing} re-computes a model's blocks; "
            f"model.arch={m.arch} has none",
            "pick a model.arch whose family declares them (ModelFamily.checkpointed), or "
            "model.activation_checkpointing=none",
        )


def pipeline_strategy(name: str, layout: Layout) -> str:
    """The strategy over the dp dim of a pipeline for dist.strategy=`name`: ddp (DDP around each stage) or one
    that shards with FSDP2 (fsdp, zero2, hsdp: fully_shard on each stage, over its tensor-parallel DTensors too);
    auto is zero2 when the stages are tensor-parallel and replicated, ddp otherwise."""
    from ddpkit.parallel.strategy import get_strategy

    if name == "auto":
        return AUTO_OVER_TP if layout.tp > 1 and layout.dp > 1 else "ddp"
    if name != "ddp" and not get_strategy(name).over_dtensors:
        raise UserError(
            f"dist.strategy={name} cannot run over the data-parallel ranks of a pipeline (dist.pp={layout.pp})",
            f"use dist.strategy=ddp or {_names('over_dtensors')} (or auto)",
        )
    if name == "ddp" and layout.tp > 1 and layout.dp > 1:
        raise UserError(
            f"dist.strategy=ddp cannot run over tensor-parallel (DTensor) pipeline stages (dist.tp={layout.tp} "
            f"dist.pp={layout.pp} leaves dp={layout.dp})",
            f"use dist.strategy=auto ({AUTO_OVER_TP}), or {_names('over_dtensors')}",
        )
    return name


def check_config(
    cfg: Any, world_size: int, per_node: int | None = None, backend: str | None = None
) -> Layout:
    """Every layout check of a config for `world_size` ranks (`per_node` of them on each node: HSDP's default
    sharding group) talking over `backend` (None: the initialised process group's, or none), before any worker
    starts; returns the Layout (with HSDP's dp_shard resolved)."""
    d = cfg.dist
    layout = layout_of(world_size, d.tp, d.pp, d.dp_shard)
    check_model(cfg, layout, backend)
    if layout.pp == 1:
        name = strategy_over_dp(d.strategy, layout, d.offload)
    else:  # parallel/pipeline/plan.py checks the rest
        name = pipeline_strategy(d.strategy, layout)
    if name == "hsdp":
        shard = shard_degree(d.dp_shard, layout.dp, layout.tp, per_node or world_size)
        return Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp, dp_shard=shard)
    if d.dp_shard is not None:
        raise UserError(
            f"dist.dp_shard={d.dp_shard} sets HSDP's sharding group, but dist.strategy is {d.strategy}",
            "add dist.strategy=hsdp, or drop dist.dp_shard",
        )
    return layout


__all__ = [
    "DIMS",
    "Layout",
    "build_mesh",
    "check_config",
    "hsdp_mesh",
    "layout_of",
    "pipeline_strategy",
    "shard_degree",
    "strategy_over_dp",
]
