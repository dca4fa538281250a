"""Synchronised BatchNorm for CPU processes (gloo): torch's SyncBatchNorm runs on GPUs only."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) with autograd: the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllReduceSum.apply(grad, ctx.group), None


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Synchronised BatchNorm for CPU processes (gloo), where torch's SyncBatchNorm is GPU-only.

    In training mode inside an initialised process group of more than one rank, the batch mean and variance are
    all-reduced (with autograd) over the group; otherwise it is plain BatchNorm. It does not subclass
    nn.SyncBatchNorm, which DDP refuses on CPU; its state_dict keys are BatchNorm's.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """BatchNorm over the union of every rank's batch in training, local BatchNorm otherwise."""
        if not self.training or self._world() <= 1:
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0] + list(range(2, input.dim()))
        x = input.double()
        count = torch.tensor([input.numel() // input.shape[1]], dtype=torch.float64, device=input.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = _AllReduceSum.apply(stats, self.process_group)
        c = self.num_features
        total = stats[-1]
        mean = stats[:c] / total
        var = (stats[c : 2 * c] / total - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * (total / (total - 1).clamp_min(1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, c] + [1] * (input.dim() - 2)
        inv = torch.rsqrt(var + self.eps)
        out = (x - mean.view(shape)) * inv.view(shape)
        out = out.to(input.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def convert_gloo_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Like nn.SyncBatchNorm.convert_sync_batchnorm, but to GlooSyncBatchNorm (for CPU processes)."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, (nn.SyncBatchNorm, GlooSyncBatchNorm)
    ):
        out = GlooSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_gloo_sync_batchnorm(child, process_group))
    return out
