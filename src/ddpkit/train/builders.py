"""The builders the Trainer (and `ddpkit eval`) asks for the parts of a run: data sets, the model with the same
initial weights on every rank (built on the meta device where its family says how its weights are made, for the
layout to make only each rank's shards), checkpoint weights into it, the autocast factory, micro-batches on the
device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ddpkit import data, models
from ddpkit.checkpoint.sharded import is_sharded
from ddpkit.config import Config
from ddpkit.data.prefetch import (
    to_device as to_device,  # micro-batches on the device, for the trainer's callers
)
from ddpkit.distributed.collectives import rank_zero_first, seed_everything
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError, first_line
from ddpkit.models.loading import init_sharded
from ddpkit.parallel.materialize import Materializer, StreamReplay
from ddpkit.parallel.mesh import Layout, build_mesh
from ddpkit.parallel.mesh.activation import checkpoint_blocks
from ddpkit.parallel.mesh.tensor import apply_tensor_parallel
from ddpkit.parallel.plan import check_config
from ddpkit.parallel.strategy import Strategy
from ddpkit.parallel.sync_bn import convert_gloo_sync_batchnorm

AMP_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_autocast(device: torch.device, amp: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the autocast context for train.amp (none, bf16, fp16) on `device`."""
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def make_datasets(cfg: Config) -> tuple[Any, Any, data.DataSpec]:
    """(train set, val set, spec); with data.download rank 0 fetches first while the others wait."""
    with rank_zero_first() if cfg.data.download else contextlib.nullcontext():
        return data.build_datasets(cfg)


def make_model(
    cfg: Config, ctx: DistContext, spec: data.DataSpec, report=None, for_eval: bool = False
) -> nn.Module:
    """The configured model with the same initial weights on every rank, whole, on ctx.device.

    for_eval: without pretrained weights (a checkpoint's replace them) and without SyncBatchNorm. model.init_from's
    weights are read once the layout is in place (init_weights), each rank its own slices.
    """
    model, make = make_model_on_meta(cfg, ctx, spec, report, for_eval)
    return make(model) if make is not None else model


def make_model_on_meta(
    cfg: Config, ctx: DistContext, spec: data.DataSpec, report=None, for_eval: bool = False
) -> tuple[nn.Module, Materializer | None]:
    """(the configured model, what makes its weights). A family that says how its weights are made
    (ModelFamily.init_weights) builds on the meta device: the Materializer makes them once the layout is applied,
    each rank only its own shards, by replaying the one-process build's draws (the same weights); with
    model.init_from it gives them memory only, which the folder fills (init_weights). Otherwise (a family
    without the rule, or model.pretrained: a weights file read whole) the model is built whole on
    ctx.device from torch's global stream after seed_everything, and the Materializer is None.
    """
    if for_eval and (cfg.model.pretrained or cfg.model.init_from):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=None, init_from=None))
    seed_everything(cfg.seed, cfg.train.deterministic)  # the same on every rank: identical initial weights
    family = models.model_family(cfg.model.arch, cfg.model)
    meta = family.init_weights is not None and not cfg.model.pretrained
    model = models.build_model(
        cfg,
        cfg.model.num_classes or spec.num_classes,
        spec.in_channels,
        spec.image_size,
        report=report,
        vocab_size=spec.vocab_size,
        block_size=spec.block_size,
        meta=meta,
    )
    distributed = ctx.world_size > 1 and not for_eval
    if not meta:
        return prepare_model(model, cfg, ctx.device, distributed), None
    # the one-process build's draws from seed_everything(cfg.seed) replayed; with model.init_from only memory
    # (its folder fills the laid-out model, each rank its own slices: init_weights)
    source = None if cfg.model.init_from else StreamReplay(model, family.init_weights, cfg.seed)
    # dist.offload=cpu: FSDP2 keeps the shards in CPU memory, where they are made
    device = torch.device("cpu") if cfg.dist.offload == "cpu" else ctx.device
    return prepare_model(model, cfg, "meta", distributed), Materializer(source, device)


def init_weights(cfg: Config, strategy: Strategy, wrapped: nn.Module, report=None) -> None:
    """model.init_from's folder into the laid-out model: each rank reads the slices it holds. Collective."""
    if cfg.model.init_from:
        init_sharded(strategy, wrapped, cfg.model.init_from, report)


def prepare_model(model: nn.Module, cfg: Config, device: torch.device, distributed: bool) -> nn.Module:
    """SyncBatchNorm when cfg.model.sync_bn and distributed, then move to `device`, then channels_last if asked."""
    device = torch.device(device)
    if cfg.model.sync_bn and distributed:
        if device.type == "cpu":
            model = convert_gloo_sync_batchnorm(model)
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def make_layout(cfg: Config, ctx: DistContext) -> tuple[Layout, Any]:
    """(layout, mesh): how the ranks split into dp x tp x pp (checked), and the ("pp", "dp", "tp") DeviceMesh
    when tensor or expert parallelism splits the model or HSDP shards it (None otherwise: the strategy runs over the
    default group; a pipeline builds its own mesh)."""
    import torch.distributed as dist

    layout = check_config(cfg, ctx.world_size, ctx.env.local_world_size, ctx.backend)
    # HSDP shards over the mesh too, and expert parallelism borrows its dp dim
    split = (layout.tp > 1 or layout.dp_shard is not None or layout.ep > 1) and layout.pp == 1
    return layout, build_mesh(layout, ctx.device.type) if split and dist.is_initialized() else None


def split_model(cfg: Config, model: nn.Module, mesh: Any) -> nn.Module:
    """Activation checkpointing and tensor parallelism applied to `model` in place, before a strategy wraps it."""
    family = models.model_family(cfg.model.arch, cfg.model)
    if cfg.model.activation_checkpointing != "none":  # full or selective
        checkpoint_blocks(family.checkpointed(model), cfg.model.activation_checkpointing)
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"], family=family)
    return model


def load_weights(
    strategy: Strategy, wrapped: nn.Module, state: dict, path: Any, arch: str, optimizer=None
) -> None:
    """A checkpoint's model (and optimizer) state into `wrapped` (a .pt file's entries, or a sharded folder's
    tensors read by every rank); one UserError when it does not fit. Collective."""
    try:
        if is_sharded(path):
            strategy.load_sharded(wrapped, optimizer, path, state)
        else:
            strategy.load(wrapped, optimizer, state["model"], state.get("optimizer") if optimizer else None)
    except (RuntimeError, KeyError, ValueError) as e:
        raise UserError(
            f"checkpoint '{path}' does not fit this model, model.arch={arch}: {first_line(e, 70, joined=True)}",
            "same model.* keys, or checkpoint.overwrite=true"
            if optimizer is not None  # resuming a run
            else "its model.* keys, or another checkpoint.path",
        ) from None
