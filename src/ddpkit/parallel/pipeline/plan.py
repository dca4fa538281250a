"""The pipeline-parallel plan, checked before any worker starts (no torch import): which stages each rank
runs, how many micro-batches a step has, and the settings a pipeline cannot run with.

Words: a *stage* is one consecutive slice of the model; `dist.pp` ranks run the stages (one each, or two each
under `interleaved_1f1b`, rank r holding stages r and r + pp); a pipeline *micro-batch* is one of the
`dist.pp_microbatches` equal chunks of a rank's batch that flow through the stages.
"""

from __future__ import annotations

from typing import Any

from ddpkit.errors import UserError
from ddpkit.models import model_family
from ddpkit.parallel.strategy import get_strategy, names_with

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def stages_per_rank(schedule: str) -> int:
    """How many stages one pipeline rank runs under `schedule`."""
    return 2 if schedule == "interleaved_1f1b" else 1


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs (the looped placement: r, r + pp, ...)."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def n_microbatches(pp: int, configured: int | None) -> int:
    """dist.pp_microbatches, or 2 x dist.pp when it is null."""
    return configured if configured is not None else 2 * pp


def check_microbatches(micro: int, pp: int, key: str, pp_key: str) -> None:
    """torch's schedules need at least one micro-batch per pipeline rank."""
    if micro < pp:
        raise UserError(
            f"{key}={micro} is fewer than the {pp} pipeline ranks ({pp_key}={pp})",
            f"use at least {pp} micro-batches (the default is {2 * pp})",
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
    ]


def _check_microbatching(cfg: Any) -> None:
    """The batch cuts into the micro-batches, and an interleaved schedule gets whole rounds of them."""
    d, batch_size = cfg.dist, cfg.train.batch_size
    micro = n_microbatches(d.pp, d.pp_microbatches)
    check_microbatches(micro, d.pp, "dist.pp_microbatches", "dist.pp")
    if batch_size % micro:
        raise UserError(
            f"train.batch_size={batch_size} cannot be cut into dist.pp_microbatches={micro} equal parts",
            f"use a train.batch_size that is a multiple of {micro}",
        )
    if d.pp_schedule == "interleaved_1f1b" and micro % d.pp:
        raise UserError(
            f"dist.pp_schedule=interleaved_1f1b needs dist.pp_microbatches a multiple of dist.pp={d.pp}, "
            f"got {micro}",
            f"use dist.pp_microbatches={2 * d.pp}",
        )


def _check_split(cfg: Any, n_stages: int) -> None:
    """The model's family declares a cut into `n_stages` stages."""
    model_family(cfg.model.arch).check_pipeline(cfg, n_stages)
