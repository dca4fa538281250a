"""The pipeline-parallel plan, checked before any worker starts (no torch import): which stages each rank
runs, how many micro-batches a step has, and the settings a pipeline cannot run with.

Words: a *stage* is one consecutive slice of the model; `dist.pp` ranks run the stages (one each, or two each
under the interleaved and V schedules); a pipeline *micro-batch* is one of the `dist.pp_microbatches` equal chunks
of a rank's batch that flow through the stages. Where a rank runs two stages they are placed in a loop
(`interleaved_1f1b`, `interleaved_zb`: rank r holds stages r and r + pp) or in a V (`zbv`, `dualpipev`: rank r
holds stages r and 2 pp - 1 - r, so the first and the last stage share rank 0 and the middle two rank pp - 1).
The zero-bubble schedules (`interleaved_zb`, `zbv`, `dualpipev`) split each backward into the input's gradient,
which the previous stage waits for, and the weights' gradient, which fills the idle time.
"""

from __future__ import annotations

from typing import Any

from ddpkit.errors import UserError
from ddpkit.models import model_family
from ddpkit.parallel.strategy import get_strategy, names_with

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
LOOPED = ("interleaved_1f1b", "interleaved_zb")  # two stages per rank, placed in a loop
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, placed in a V
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # the input's and the weights' gradients apart


def stages_per_rank(schedule: str) -> int:
    """How many stages one pipeline rank runs under `schedule`."""
    return 2 if schedule in LOOPED + V_SHAPED else 1


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in increasing order: r, r + pp, ... (looped), or r and
    2 pp - 1 - r (V)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs stage `stage` (the inverse of stage_ids)."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def n_microbatches(pp: int, configured: int | None) -> int:
    """dist.pp_microbatches, or 2 x dist.pp when it is null."""
    return configured if configured is not None else 2 * pp


def check_microbatches(micro: int, pp: int, schedule: str, where: str = "dist.") -> None:
    """torch's schedules need at least one micro-batch per pipeline rank; the looped ones whole rounds of pp
    micro-batches, DualPipeV at least one per stage (2 pp). `where`: how the settings are spelled, `dist.` (the
    config keys) or `ddpkit.prepare: ` (its arguments)."""
    key, pp_key = ("dist.pp_microbatches", "dist.pp") if where == "dist." else ("pp_microbatches", "pp")
    say = "" if where == "dist." else where
    if micro < pp:
        raise UserError(
            f"{say}{key}={micro} is fewer than the {pp} pipeline ranks ({pp_key}={pp})",
            f"use at least {pp} micro-batches (the default is {2 * pp})",
        )
    sched = f"{say}{key.replace('microbatches', 'schedule')}={schedule}"
    if schedule in LOOPED and micro % pp:
        raise UserError(
            f"{sched} needs {key} a multiple of {pp_key}={pp}, got {micro}", f"use {key}={2 * pp}"
        )
    if schedule == "dualpipev" and micro < 2 * pp:
        raise UserError(
            f"{sched} needs at least one micro-batch per stage ({2 * pp}), {key} is {micro}",
            f"use {key}={2 * pp} or more",
        )


def check_pipeline(cfg: Any, world_size: int | None = None) -> None:
    """Refuse, with one line, a pipeline setting that cannot work (called before workers start; the world size
    is checked when it is known)."""
    d = cfg.dist
    if d.pp == 1:
        return
    if world_size is not None and world_size % (d.pp * d.tp):
        raise UserError(
            f"{world_size} process(es) cannot hold dist.pp={d.pp} x dist.tp={d.tp}",
            f"start a multiple of {d.pp * d.tp} processes",
        )
    for bad, what, hint in _refusals(cfg):
        if bad:
            raise UserError(f"{what} cannot run with dist.pp={d.pp}", hint)
    _check_microbatching(cfg)
    _check_split(cfg, d.pp * stages_per_rank(d.pp_schedule))


def _refusals(cfg: Any) -> list[tuple[bool, str, str]]:
    """(set, the setting, what to do instead) of every setting a pipeline cannot run with."""
    d, train, model = cfg.dist, cfg.train, cfg.model
    return [
        (
            train.amp == "fp16",
            "train.amp=fp16",
            "use train.amp=bf16 or none (no gradient scaler across stages)",
        ),
        (
            d.grad_compression != "none",
            f"dist.grad_compression={d.grad_compression}",
            "drop it: stage gradients go through plain DDP",
        ),
        (
            d.strategy != "auto" and not get_strategy(d.strategy).with_pp,
            f"dist.strategy={d.strategy}",
            f"use dist.strategy={names_with('with_pp')} (or auto) over the data-parallel ranks of a pipeline",
        ),
        (
            d.offload != "none",
            f"dist.offload={d.offload}",
            f"offload applies to {names_with('offloads')}, not to pipelines",
        ),
        (
            model.sync_bn,
            "model.sync_bn=true",
            "drop it: the stages hold different BatchNorm layers, there is nothing to synchronise across them",
        ),
        (model.compile, "model.compile=true", "drop it: stages run eagerly under the pipeline schedules"),
        (
            d.pp_schedule in SPLIT_BACKWARD and d.strategy != "auto" and _regathers(d.strategy),
            f"dist.strategy={d.strategy} (parameters re-gathered for each backward) with "
            f"dist.pp_schedule={d.pp_schedule}",
            "use dist.strategy=zero2 (sharded, gathered once per step), which the split backward of the "
            "zero-bubble schedules can follow, or another dist.pp_schedule",
        ),
        (
            d.pp_schedule in SPLIT_BACKWARD and model.activation_checkpointing == "selective",
            f"model.activation_checkpointing=selective with dist.pp_schedule={d.pp_schedule}",
            "use model.activation_checkpointing=full (torch's selective recomputation allows one backward per "
            "block, the split backward runs two), or another dist.pp_schedule",
        ),
    ]


def _regathers(strategy: str) -> bool:
    """The strategy reshards a stage's parameters after its forward (FSDP2's default): torch's split backward
    then finds the sharded parameters in place of those the forward used, and computes wrong gradients."""
    return getattr(get_strategy(strategy).cls, "reshard_after_forward", False) is not False


def _check_microbatching(cfg: Any) -> None:
    """The batch cuts into the micro-batches, and the schedule gets as many as it needs."""
    d, batch_size = cfg.dist, cfg.train.batch_size
    micro = n_microbatches(d.pp, d.pp_microbatches)
    check_microbatches(micro, d.pp, d.pp_schedule)
    if batch_size % micro:
        raise UserError(
            f"train.batch_size={batch_size} cannot be cut into dist.pp_microbatches={micro} equal parts",
            f"use a train.batch_size that is a multiple of {micro}",
        )


def _check_split(cfg: Any, n_stages: int) -> None:
    """The model's family declares a cut into `n_stages` stages."""
    model_family(cfg.model.arch, cfg.model).check_pipeline(cfg, n_stages)
