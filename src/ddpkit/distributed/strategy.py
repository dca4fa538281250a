"""single / dp / ddp / zero1 / fsdp behind one small interface: wrap, sync control, optimizer, full state dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit.distributed.compression import Compression
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import UserError


def resolve_strategy(name: str, world_size: int) -> str:
    """`auto` -> ddp with several processes, single with one; refuse combinations that cannot work."""
    if name == "auto":
        return "ddp" if world_size > 1 else "single"
    if name in ("single", "dp") and world_size > 1:
        raise UserError(
            f"dist.strategy={name} runs one process but {world_size} were started",
            "use dist.strategy=ddp (or auto) with several processes",
        )
    return name


def unwrap_module(model: nn.Module) -> nn.Module:
    """The module inside DDP, DataParallel and torch.compile wrappers."""
    while isinstance(inner := getattr(model, "module", None) or getattr(model, "_orig_mod", None), nn.Module):
        model = inner
    return model


class Strategy:
    """How the model and optimizer are spread over the ranks. Subclasses override what differs."""

    name = "single"

    def __init__(self, ctx: DistContext, ddp_options: dict | None = None):
        self.ctx = ctx
        self.ddp_options = dict(ddp_options or {})  # DistributedDataParallel's own keyword arguments

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call forward/backward on."""
        return model

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The user's module (what a checkpoint stores): inside DDP, DataParallel and torch.compile wrappers."""
        while isinstance(
            inner := getattr(wrapped, "module", None) or getattr(wrapped, "_orig_mod", None), nn.Module
        ):
            wrapped = inner
        return wrapped

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """What evaluation calls: the plain module, so uneven shards run no collective."""
        return self.unwrap(wrapped)

    @property
    def collective_forward(self) -> bool:
        """True when every forward is a collective (fsdp): all ranks must run the same number of them."""
        return False

    def sync_context(self, wrapped: nn.Module, sync: bool):
        """Gradient sync on (last micro-step) or off (the others)."""
        return contextlib.nullcontext()

    def build_optimizer(
        self, model: nn.Module, factory: Callable[..., torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        return factory(model)

    def hook_state(self) -> dict | None:
        """The gradient-communication hook's state to checkpoint (None: no hook)."""
        return None

    def load_hook_state(self, state: dict | None) -> None:
        """Restore hook_state() (nothing to do without a hook)."""

    def model_state(self, wrapped: nn.Module) -> dict:
        return self.unwrap(wrapped).state_dict()

    def optimizer_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        """The full optimizer state on rank 0 (None elsewhere when it has to be gathered). Collective."""
        return optimizer.state_dict()

    def load(
        self,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict,
        optim_sd: dict | None,
    ):
        self.unwrap(wrapped).load_state_dict(model_sd)
        if optimizer is not None and optim_sd is not None:
            optimizer.load_state_dict(optim_sd)


class DataParallelStrategy(Strategy):
    """nn.DataParallel: one process, threads over the local GPUs (the tutorials' step 2)."""

    name = "dp"

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.ctx.device.type == "cuda" and torch.cuda.device_count() > 1:
            return nn.DataParallel(model)
        return model


class DDPStrategy(Strategy):
    """DistributedDataParallel, with an optional gradient-compression hook (torch's own DDP comm hooks)."""

    name = "ddp"

    def __init__(
        self, ctx: DistContext, ddp_options: dict | None = None, compression: Compression | None = None
    ):
        super().__init__(ctx, ddp_options)
        self.compression = compression or Compression()
        self._hook_state = None

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids, **self.ddp_options)
        self._hook_state = self.compression.register(ddp)
        return ddp

    def hook_state(self) -> dict | None:
        """The compression hook's state (PowerSGD's error feedback, warm-start factors, step, RNG) for a checkpoint."""
        return self.compression.state_dict(self._hook_state)

    def load_hook_state(self, state: dict | None) -> None:
        self.compression.load_state_dict(self._hook_state, state, self.ctx.device)

    def sync_context(self, wrapped: nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else wrapped.no_sync()


class Zero1Strategy(DDPStrategy):
    """DDP plus ZeroRedundancyOptimizer: each rank keeps 1/N of the optimizer state."""

    name = "zero1"

    def build_optimizer(self, model, factory):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        template = factory(model)
        defaults = {
            k: v for k, v in template.defaults.items() if k not in ("differentiable", "foreach", "fused")
        }
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(template), **defaults)

    def optimizer_state(self, wrapped, optimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.ctx.rank == 0 else None


class FSDPStrategy(Strategy):
    """FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over the ranks."""

    name = "fsdp"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for child in model.children():  # one shard group per top-level block, then the root
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        return model

    def unwrap(self, wrapped):
        return wrapped

    def eval_module(self, wrapped):
        return wrapped

    @property
    def collective_forward(self) -> bool:
        return True

    def sync_context(self, wrapped, sync):
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def model_state(self, wrapped):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(wrapped, options=self._options())

    def optimizer_state(self, wrapped, optimizer):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(wrapped, optimizer, options=self._options())
        return sd if self.ctx.rank == 0 else None

    def load(self, wrapped, optimizer, model_sd, optim_sd):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(wrapped, model_sd, options=opts)
        if optimizer is not None and optim_sd is not None:
            set_optimizer_state_dict(wrapped, optimizer, optim_sd, options=opts)


def ddp_options(dist_cfg) -> dict:
    """DistributedDataParallel's keyword arguments from dist.bucket_cap_mb, static_graph, grad_as_bucket_view."""
    out: dict = {}
    if dist_cfg.bucket_cap_mb is not None:
        out["bucket_cap_mb"] = dist_cfg.bucket_cap_mb
    if dist_cfg.static_graph:
        out["static_graph"] = True
    if dist_cfg.grad_as_bucket_view:
        out["gradient_as_bucket_view"] = True
    return out


def build_strategy(
    name: str, ctx: DistContext, ddp_options: dict | None = None, compression: Compression | None = None
) -> Strategy:
    """The Strategy for dist.strategy (after `auto` is resolved); ddp_options go to DistributedDataParallel,
    `compression` registers its gradient hook on it (ddp and zero1)."""
    name = resolve_strategy(name, ctx.world_size)
    if name in ("ddp", "zero1", "fsdp") and not dist.is_initialized():
        return Strategy(ctx)  # one process without a group: the plain module computes the same numbers
    return {
        "single": Strategy,
        "dp": DataParallelStrategy,
        "ddp": DDPStrategy,
        "zero1": Zero1Strategy,
        "fsdp": FSDPStrategy,
    }[name](ctx, ddp_options, **({"compression": compression} if name in ("ddp", "zero1") else {}))
