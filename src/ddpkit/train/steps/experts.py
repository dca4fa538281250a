"""The steps of a mixture of experts, under any layout: the runner the layout asks for (plain or pipeline) with
what routed experts add to a step.

- Before a step's backward each MoE block learns the scale its auxiliary loss joins the backward with (the
  runner's `loss_scale`), so the loss it adds is scaled as the cross-entropy is.
- After it, with model.moe_balance=bias, each block's routing bias moves by model.moe_bias_rate towards the
  experts that got fewer than the mean of the step's tokens, counted over the step's whole global batch (summed
  over the data-parallel ranks): the same update on every rank and in every layout, outside the gradient.
- At each metrics line the auxiliary loss and the load (the busiest expert's tokens over the mean, per MoE block)
  since the last line, over every rank (tensor-parallel peers, which route the same tokens, counted once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.models import model_family
from ddpkit.models.experts import MoE
from ddpkit.train.steps.plain import StepRunner


def takes(cfg: Any) -> bool:
    """A model whose family gives it routed experts."""
    return model_family(cfg.model.arch, cfg.model).routed_experts(cfg.model) > 0


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ExpertSteps:
    """`inner`'s steps (any StepRunner: every attribute not here is its), with the routing's: `layers` this rank's
    MoE blocks by block number, `counted` whether this rank's routing counts are counted (tensor rank 0),
    `n_layer` the model's blocks."""

    def __init__(self, inner: StepRunner, n_layer: int, counted: bool):
        self.inner, self.n_layer, self.counted = inner, n_layer, counted
        self.layers: dict[int, MoE] = {}
        for name, module in inner.model.named_modules():
            if isinstance(module, MoE):  # "blocks.3.mlp", or "0.blocks.3.mlp" in a pipeline's stages
                parts = name.split(".")
                self.layers[int(parts[parts.index("blocks") + 1])] = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_backward(self, micro_batches: Iterable, sums: Any) -> list[torch.Tensor]:
        scale = self.inner.loss_scale()
        for moe in self.layers.values():
            moe.aux_scale = scale
        losses = self.inner.forward_backward(micro_batches, sums)
        self._balance()
        return losses

    @torch.no_grad()
    def _balance(self) -> None:
        """The step's tokens per expert over the data-parallel ranks; the bias update where it balances (no
        collective without it: model.moe_balance is the same on every rank)."""
        if not self.layers:
            return
        if all(m.router.expert_bias is None for m in self.layers.values()):
            for moe in self.layers.values():
                moe.step_tokens.zero_()
            return
        tokens = torch.stack([m.step_tokens for m in self.layers.values()])
        if _grouped():
            dist.all_reduce(tokens, group=self.inner.dp_group)
        for moe, got in zip(self.layers.values(), tokens, strict=True):
            bias = moe.router.expert_bias
            if bias is not None:
                bias += moe.routing.bias_rate * torch.sign(got.mean() - got).to(bias.dtype)
            moe.step_tokens.zero_()

    @torch.no_grad()
    def routing_fields(self) -> dict[str, Any]:
        """moe_aux_loss, moe_balance_max and moe_balance_mean since the last call, over every rank (collective)."""
        width = next(iter(self.layers.values())).routing.n_experts if self.layers else 0
        if _grouped():  # every rank the same width: the widest
            w = torch.tensor([width], dtype=torch.int64)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            width = int(w)
        sums = torch.zeros(self.n_layer, width + 2, dtype=torch.float64)
        for i, moe in self.layers.items():
            if self.counted:
                sums[i] = torch.cat([moe.load, moe.aux_sums]).cpu()
            moe.load.zero_()
            moe.aux_sums.zero_()
        if _grouped():
            dist.all_reduce(sums)
        return routing_summary(sums)


def routing_summary(sums: torch.Tensor) -> dict[str, Any]:
    """The metrics of per-block [tokens per expert..., auxiliary loss sum, sequences] rows (blocks without
    experts or tokens: zeros)."""
    load, aux, seqs = sums[:, :-2], sums[:, -2], sums[:, -1]
    routed = load.sum(1) > 0
    if not routed.any():
        return {}
    load = load[routed]
    balance = load.max(1).values / load.mean(1)
    return {
        "moe_aux_loss": float(aux.sum() / seqs.sum()) if seqs.sum() > 0 else None,
        "moe_balance_max": round(float(balance.max()), 6),
        "moe_balance_mean": round(float(balance.mean()), 6),
    }


def around(inner: StepRunner, cfg: Any, ctx: Any, *, layout: Any, **parts: Any) -> ExpertSteps:
    """`inner` (the layout's runner) with the routing's steps around it (steps.AROUND)."""
    return ExpertSteps(inner, cfg.model.n_layer, counted=layout.coords(ctx.rank)["tp"] == 0)
