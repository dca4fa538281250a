"""The plan of a run's parallel layout, decided before anything is built: which strategy runs over the
data-parallel ranks (dist.strategy=auto resolved, a combination torch cannot do refused: each asked of the
strategy entries' facts), whether the model's family can split the model as asked, HSDP's sharding group; and the
Strategy so decided, built.

It stands above the mesh's geometry (parallel/mesh: Layout) and the strategy registry (parallel/strategy.py),
which know nothing of each other. Importing it imports no torch: the command line checks a config's layout
before any worker starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit.errors import UserError
from ddpkit.models import model_family
from ddpkit.parallel.mesh import Layout, check_ep, layout_of, shard_degree
from ddpkit.parallel.strategy import Strategy, get_strategy, names_with, picked

if TYPE_CHECKING:
    from ddpkit.distributed.runtime import DistContext
    from ddpkit.parallel.compression import Compression


def resolve_strategy(name: str, world_size: int) -> str:
    """`auto` -> the strategy picked for several processes (ddp), or for one (single); refuse combinations that
    cannot work."""
    if name == "auto":
        return picked("several") if world_size > 1 else picked("one")
    if get_strategy(name).one_process and world_size > 1:
        raise UserError(
            f"dist.strategy={name} runs one process but {world_size} were started",
            f"use dist.strategy={picked('several')} (or auto) with several processes",
        )
    return name


def strategy_over_dp(name: str, layout: Layout, offload: str = "none") -> str:
    """The strategy that runs over the dp dim of `layout` for dist.strategy=`name` (auto resolved); a UserError
    for a combination torch cannot do."""
    if offload == "cpu":
        name = picked("offload") if name == "auto" else name
        if not get_strategy(name).offloads:
            raise UserError(
                f"dist.offload=cpu needs a strategy that shards with FSDP2 ({names_with('offloads')}), not {name}",
                f"use dist.strategy={picked('offload')}, or dist.offload=none",
            )
        if layout.dp == 1:
            raise UserError(
                "dist.offload=cpu needs several data-parallel processes (FSDP2 shards over them)",
                "start more processes (e.g. --nproc-per-node 2), or use dist.offload=none",
            )
    if name == "auto" and layout.tp > 1 and layout.dp > 1:
        return picked("tp")
    plain = picked("one")  # the plain module: what each rank of one replica runs, whatever splits the model
    if layout.parallel and name not in ("auto", plain) and get_strategy(name).one_process:
        raise UserError(  # it would silently run as the plain module: a process per rank is not one process
            f"dist.strategy={name} runs one process, not the {layout.tp * layout.pp} ranks of "
            f"dist.tp={layout.tp} dist.pp={layout.pp}",
            "use dist.strategy=auto",
        )
    if layout.dp == 1 and layout.parallel and name != "auto" and get_strategy(name).one_process:
        return plain  # nothing to do over one data-parallel replica
    resolved = resolve_strategy(name, layout.dp)
    if layout.tp > 1 and resolved != plain and not get_strategy(resolved).over_dtensors:
        raise UserError(
            f"dist.strategy={resolved} cannot run over tensor-parallel (DTensor) parameters (dist.tp={layout.tp})",
            f"use dist.strategy=auto ({picked('tp')} over the data-parallel ranks), or "
            f"{names_with('over_dtensors')}",
        )
    return resolved


def pipeline_strategy(name: str, layout: Layout) -> str:
    """The strategy over the dp dim of a pipeline for dist.strategy=`name`: one that replicates each stage (ddp:
    DDP around it) or one that shards each stage with FSDP2 (fsdp, zero2, hsdp: over its tensor-parallel DTensors
    too); auto is the pick over tensor-parallel ranks (zero2) when the stages are tensor-parallel and replicated,
    the pick for several processes (ddp) otherwise."""
    if name == "auto":
        return picked("tp") if layout.tp > 1 and layout.dp > 1 else picked("several")
    entry = get_strategy(name)
    if not entry.with_pp:
        raise UserError(
            f"dist.strategy={name} cannot run over the data-parallel ranks of a pipeline (dist.pp={layout.pp})",
            f"use dist.strategy={names_with('with_pp')} (or auto)",
        )
    if not entry.over_dtensors and layout.tp > 1 and layout.dp > 1:
        raise UserError(
            f"dist.strategy={name} cannot run over tensor-parallel (DTensor) pipeline stages (dist.tp={layout.tp} "
            f"dist.pp={layout.pp} leaves dp={layout.dp})",
            f"use dist.strategy=auto ({picked('tp')}), or {names_with('over_dtensors')}",
        )
    return name


def check_model(cfg: Any, layout: Layout, backend: str | None = None) -> None:
    """The model's family can split it as asked: it declares a tensor-parallel plan (its sizes divisible by tp,
    and the sequence too where sequence parallelism splits it: a whole model over `backend`, see
    models.blocks.sequence_parallel_pays) and the blocks activation checkpointing re-computes."""
    from ddpkit.models.blocks import sequence_parallel_pays  # torch: this module imports none

    m, tp = cfg.model, layout.tp
    family = model_family(m.arch, m)
    if tp > 1 and family.tp_plan is None:
        raise UserError(
            f"dist.tp={tp} needs a model with a tensor-parallel plan; model.arch={m.arch} has none",
            "pick a model.arch whose family declares one, or ddpkit.prepare(model, tp=..., tp_plan=...)",
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
    _check_experts(m, family, layout.ep)
    if getattr(m, "tie_embeddings", False) and (tp > 1 or layout.pp > 1):
        raise UserError(
            f"model.tie_embeddings=true is not supported with dist.tp={tp} dist.pp={layout.pp}",
            "set model.tie_embeddings=false, or train without tensor and pipeline parallelism",
        )
    if m.activation_checkpointing != "none" and family.checkpointed is None:
        raise UserError(
            f"model.activation_checkpointing={m.activation_checkpointing} re-computes a model's blocks; "
            f"model.arch={m.arch} has none",
            "pick a model.arch that declares them, or model.activation_checkpointing=none",
        )


def _check_experts(m: Any, family: Any, ep: int) -> None:
    """dist.ep splits the model's routed experts into equal parts."""
    if ep == 1:
        return
    experts = family.routed_experts(m)
    if not experts:
        raise UserError(
            f"dist.ep={ep} splits a mixture of experts' routed experts, but model.arch={m.arch} has none",
            "give the model routed experts (model.n_experts), or use dist.ep=1",
        )
    if experts % ep:
        raise UserError(
            f"model.n_experts={experts} cannot be split over dist.ep={ep} ranks (it must be a multiple of {ep})",
            f"use a model.n_experts that is a multiple of {ep}, or another dist.ep",
        )


def _check_strategy_with_experts(name: str, ep: int) -> None:
    if ep > 1 and not get_strategy(name).with_ep:
        raise UserError(
            f"dist.strategy={name} cannot run with expert parallelism (dist.ep={ep})",
            f"use dist.strategy={names_with('with_ep')} (or auto)",
        )


def _check_memory(memory: str, name: str) -> None:
    """dist.memory=lean shards each block's parts: only a strategy that shards gradients with FSDP2 has units."""
    if memory == "lean" and not get_strategy(name).shards_gradients:
        raise UserError(
            f"dist.memory=lean shards each block's parts with FSDP2, which dist.strategy={name} does not use",
            f"use dist.strategy={names_with('shards_gradients')} with several processes, or dist.memory=fast",
        )


def check_config(
    cfg: Any, world_size: int, per_node: int | None = None, backend: str | None = None
) -> Layout:
    """Every layout check of a config for `world_size` ranks (`per_node` of them on each node: HSDP's default
    sharding group) talking over `backend` (None: the initialised process group's, or none), before any worker
    starts; returns the Layout (with HSDP's dp_shard resolved)."""
    d = cfg.dist
    layout = layout_of(world_size, d.tp, d.pp, d.dp_shard, d.ep)
    check_model(cfg, layout, backend)
    if layout.pp == 1:
        name = strategy_over_dp(d.strategy, layout, d.offload)
    else:  # parallel/pipeline/plan.py checks the rest
        name = pipeline_strategy(d.strategy, layout)
    _check_strategy_with_experts(name, layout.ep)
    _check_memory(d.memory, name)
    if get_strategy(name).hybrid:
        shard = shard_degree(d.dp_shard, layout.dp, layout.tp, per_node or world_size)
        check_ep(layout.ep, layout.dp, shard, f"{world_size} process(es)")
        return Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp, dp_shard=shard, ep=layout.ep)
    if d.dp_shard is not None:
        raise UserError(
            f"dist.dp_shard={d.dp_shard} sets HSDP's sharding group, but dist.strategy is {d.strategy}",
            f"add dist.strategy={names_with('hybrid')}, or drop dist.dp_shard",
        )
    return layout


def build_strategy(
    name: str,
    ctx: DistContext,
    ddp_options: dict | None = None,
    compression: Compression | None = None,
    *,
    mesh: Any = None,
    offload: str = "none",
    memory: str = "fast",
    dp_shard: int | None = None,
    amp: str = "none",
    experts: Any = None,
) -> Strategy:
    """The Strategy for dist.strategy (after `auto` is resolved); ddp_options go to DistributedDataParallel,
    `compression` registers its gradient hook (strategies whose entry says `compression`).

    `mesh`: the ("pp", "dp", "tp") DeviceMesh of a split model; the strategy then runs over its "dp" dim.
    `offload`: dist.offload (cpu: FSDP2's CPU offload, fsdp and zero2 only).
    `memory`: dist.memory (lean: each block's parts sharded as units of their own, fsdp, hsdp and zero2 only).
    `dp_shard`: hsdp's ranks per sharding group (None: the processes per node).
    `amp`: train.amp (bf16: FSDP2 gathers the parameters in bf16 and reduces the gradients in float32).
    `experts`: the ExpertMeshes of dist.ep > 1 (parallel/experts/meshes.py), which the routed experts are split
    and reduced over.
    """
    import torch.distributed as dist

    layout = Layout(ctx.world_size)
    if mesh is not None:
        sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        layout = Layout(dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"])
    entry = get_strategy(strategy_over_dp(name, layout, offload))
    if entry.needs_group and not dist.is_initialized():
        return Strategy(ctx)  # one process without a group: the plain module computes the same numbers
    strategy = entry.cls(ctx, ddp_options, compression if entry.compression else None)
    strategy.mesh, strategy.offload, strategy.amp, strategy.experts = mesh, offload, amp, experts
    strategy.memory = memory
    if dp_shard is not None:
        strategy.dp_shard = dp_shard
    return strategy
