"""One device mesh for every parallel layout: pipeline x data x tensor; the modules beside it split the model
itself over the mesh (`tensor`: tensor parallelism; `activation`: activation checkpointing).

The ranks form a (pp, dp, tp) grid, tensor-parallel peers next to each other (rank = (pp_i * dp + dp_j) * tp +
tp_k), so a tensor-parallel group sits on one node whenever tp divides the processes per node. The data-parallel
degree is what is left: world_size / (tp * pp). Ranks of one tensor or pipeline group read the same samples (the
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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "tp": k} of `rank`, where rank = (i * dp + j) * tp + k."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a layout of {self.world_size} ranks")
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def counts(self, rank: int) -> bool:
        """True on the one rank per dp replica whose sums the metrics count: tensor rank 0 of the last stage
        (tensor-parallel peers hold the same numbers, and only the last stage has the loss)."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def describe(self, rank: int) -> str:
        """`dp=1 tp=0 pp=0` (this rank's coordinates, as `ddpkit info` shows them)."""
        c = self.coords(rank)
        return f"dp={c['dp']} tp={c['tp']} pp={c['pp']}"

    @property
    def parallel(self) -> bool:
        """True when the model itself is split (tensor or pipeline parallel)."""
        return self.tp > 1 or self.pp > 1


def layout_of(world_size: int, tp: int = 1, pp: int = 1) -> Layout:
    """The Layout of `world_size` ranks with these degrees; a UserError when tp * pp does not divide it."""
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
    return Layout(dp=world_size // (tp * pp), tp=tp, pp=pp)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "tp") DeviceMesh of `layout` over the default process group (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)


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


def check_model(cfg: Any, layout: Layout) -> None:
    """The model's family can split it as asked: it declares a tensor-parallel plan (its sizes divisible by tp)
    and the blocks activation checkpointing re-computes."""
    from ddpkit.models import model_family  # imported here: this module imports no torch

    m, tp = cfg.model, layout.tp
    family = model_family(m.arch)
    if tp > 1 and family.tp_plan is None:
        raise UserError(
            f"dist.tp={tp} needs a model with a tensor-parallel plan; model.arch={m.arch} has none",
            "pick a model.arch whose family declares one (ModelFamily.tp_plan), or "
            "ddpkit.prepare(model, tp=..., tp_plan=...) with a plan of your own",
        )
    for key, value in family.tp_sizes(cfg) if tp > 1 else ():
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


def check_config(cfg: Any, world_size: int) -> Layout:
    """Every layout check of a config for `world_size` ranks, before any worker starts; returns the Layout."""
    layout = layout_of(world_size, cfg.dist.tp, cfg.dist.pp)
    check_model(cfg, layout)
    if layout.pp == 1:  # a pipeline runs DDP over its replicas (parallel/pipeline/plan.py checks the rest)
        strategy_over_dp(cfg.dist.strategy, layout, cfg.dist.offload)
    elif layout.tp > 1 and layout.dp > 1:
        raise UserError(
            f"dist.tp={layout.tp} x dist.pp={layout.pp} on {world_size} processes leaves dp={layout.dp}: the "
            "pipeline's DDP over the data-parallel replicas cannot take tensor-parallel (DTensor) stages",
            f"start tp x pp = {layout.tp * layout.pp} processes, or drop dist.tp",
        )
    return layout


__all__ = ["DIMS", "Layout", "build_mesh", "check_config", "layout_of", "strategy_over_dp"]
