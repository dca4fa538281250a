"""Routed experts, the part a mixture-of-experts family (mixtral/, or one of your own) builds its blocks with, and
what expert parallelism (parallel/experts/) and the trainer's step (train/steps/experts.py) find in a model. A
mixture-of-experts block's MLP (`MoE`): a router picks each token's `experts_per_token` experts (token choice), the
tokens go through their experts' SwiGLUs (sorted by expert: one grouped matmul, below) and come back weighted
by their routing scores; shared experts (when the model has them) see every token. No token is ever dropped
(dropless), so a token's output does not depend on where the other tokens are: every layout computes what one
process does.

What evens the experts' load:
- the auxiliary loss (Switch Transformer's, as Mixtral and Qwen3-MoE use it): per sequence E x sum_i f_i P_i (f_i
  the share of the sequence's routed slots that went to expert i, P_i its mean score), 1 when balanced; the mean
  over the sequences and the model's MoE blocks, x model.moe_aux_loss, joins the loss. Per sequence, so that it
  adds up over micro-batches, data-parallel ranks and pipeline micro-batches as the cross-entropy does. It is
  joined in backward (`JoinLoss`): the block's output carries it, so a pipeline stage's blocks add theirs where
  the loss of the last stage cannot reach them; `aux_scale` is the scale the backward's loss has (the trainer's
  step sets 1 / train.grad_accum_steps), 1 for a loss of one batch.
- the bias (DeepSeek-V3's auxiliary-loss-free balancing): `router.expert_bias` is added to the scores that choose
  the experts (not to the weights); after each optimizer step it moves by model.moe_bias_rate towards the experts
  that got fewer tokens than the mean (`step_tokens`, over the step's whole global batch: train/steps/experts.py).

The block counts, in training, the tokens each expert got (`step_tokens`: this optimizer step; `load`: since the
metrics last read it) and the auxiliary loss (`aux_sums`), never twice for a block that activation checkpointing
re-computes. Expert parallelism (parallel/experts/) sets `exchange`: the all-to-all that sends the sorted tokens
to their experts' ranks and back.

The experts' SwiGLU over tokens sorted by expert is `torch._grouped_mm` (one kernel for every expert) or a loop of
one matmul per expert, whichever the device runs faster (`FASTER`, benchmarks/moe_matmul.py): the same numbers
either way (within float rounding). The grouped kernel takes matrices whose strides are multiples of 16 bytes (the
width and the experts' width a multiple of 4 in float32, of 8 in bfloat16); other shapes take the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.models.keys import aux_weight, moe_blocks

# device type -> the faster of "grouped" and "loop" there (benchmarks/moe_matmul.py). CUDA: torch's grouped GEMM
# (a bfloat16 kernel on compute capability 9.0 and later, where torchtitan uses it); CPU: the loop, measured
# faster at every size of RESULTS.md §22
FASTER = {"cpu": "loop", "cuda": "grouped"}


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(s * t.element_size() % 16 == 0 for t in tensors for s in t.stride()[:-1] if s != 1) and all(
        t.stride(-1) == 1 or t.stride(-2) == 1 for t in tensors
    )


def grouped_here(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the grouped kernel runs `x` (tokens, width) against `weights` (experts, out, in) on this device."""
    if not hasattr(torch, "_grouped_mm") or FASTER.get(x.device.type) != "grouped":
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    return _aligned(x, *(w.transpose(-2, -1) for w in weights))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes a matmul of `x` in (x's own without autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def swiglu_experts(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """down_e(silu(gate_e x) * up_e x) of each row x of `x` (rows sorted by expert, `counts[e]` rows of expert e)
    with the experts' weights `gate`, `up` (experts, hidden, width) and `down` (experts, width, hidden)."""
    dtype = _compute_dtype(x)
    if dtype != x.dtype or gate.dtype != dtype:
        x, gate, up, down = (t.to(dtype) for t in (x, gate, up, down))
    if grouped_here(x, gate, up, down):
        offs = counts.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, gate.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)
    return swiglu_loop(x, counts, gate, up, down)


def swiglu_loop(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """swiglu_experts as one matmul per expert that has rows."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n or (e == len(counts) - 1 and not outs):
            # no rows at all: the last expert on none, so that the result still hangs on `x` and the weights
            # (under expert parallelism the backward of the all-to-all that brought `x` must run on every rank)
            xe = x[start : start + n]
            outs.append((F.silu(xe @ gate[e].T) * (xe @ up[e].T)) @ down[e].T)
            start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@dataclass(frozen=True)
class Routing:
    """How a model's MoE blocks route (from its config keys, models/keys.py)."""

    n_experts: int
    top_k: int = 2
    score: str = "softmax"  # or "sigmoid"
    norm_topk: bool = True
    aux_weight: float = 0.0  # model.moe_aux_loss resolved
    bias: bool = False  # model.moe_balance=bias
    bias_rate: float = 0.001
    n_moe_blocks: int = 1  # the auxiliary loss is the mean over the model's MoE blocks

    @classmethod
    def of(cls, m: Any) -> Routing:
        """The routing of cfg.model `m` (a mixture-of-experts config)."""
        return cls(
            n_experts=m.n_experts,
            top_k=m.experts_per_token,
            score=m.moe_score,
            norm_topk=m.moe_norm_topk,
            aux_weight=aux_weight(m),
            bias=m.moe_balance == "bias",
            bias_rate=m.moe_bias_rate,
            n_moe_blocks=len(moe_blocks(m.n_layer, m.moe_every)),
        )


class JoinLoss(torch.autograd.Function):
    """Identity on `out`; in backward the scalar `loss` gets the gradient `scale`, as if it had been added to the
    loss whose backward runs (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, loss
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full_like(ctx.like, ctx.scale), None


class Exchange(Protocol):
    """Expert parallelism's token exchange (parallel/experts/dispatch.py)."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class Router(nn.Module):
    """Scores of every expert for each token, and its top-k choice (`expert_bias` shifts the choice only)."""

    def __init__(self, n_embd: int, routing: Routing):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.n_experts, n_embd))
        if routing.bias:
            self.register_buffer("expert_bias", torch.zeros(routing.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (tokens, E) in float32, the chosen experts (tokens, k), their weights (tokens, k))."""
        r = self.routing
        logits = F.linear(h.float(), self.weight.float())
        scores = logits.softmax(-1) if r.score == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        chosen = choice.topk(r.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if r.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if r.score == "sigmoid" else 0.0))
        return scores, chosen, weights


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, each a (experts, ...) tensor: `gate` and `up` (experts, hidden, width),
    `down` (experts, width, hidden). Under expert parallelism each is a DTensor split over the experts (dim 0) and
    a rank computes with its own experts (`to_local`)."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.up = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.down = nn.Parameter(torch.empty(n_experts, n_embd, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # a DTensor (expert parallelism): this rank's experts, the gradient flowing back into the shard
        local = [w.to_local() if hasattr(w, "to_local") else w for w in (self.gate, self.up, self.down)]
        return swiglu_experts(x, counts, *local)


def init_experts(experts: GroupedExperts, std: float, out_std: float) -> None:
    """Normal weights (the down projection's `out_std`, scaled by depth as the dense residual projections)."""
    with torch.no_grad():
        nn.init.normal_(experts.gate, 0.0, std)
        nn.init.normal_(experts.up, 0.0, std)
        nn.init.normal_(experts.down, 0.0, out_std)


class MoE(nn.Module):
    """The MLP of a mixture-of-experts block: (B, T, width) -> (B, T, width)."""

    LOCAL_BUFFERS = ("step_tokens", "load", "aux_sums")  # each rank's own counts (no data-parallel sync)

    def __init__(self, n_embd: int, hidden: int, routing: Routing, shared: nn.Module | None = None):
        super().__init__()
        self.routing = routing
        self.router = Router(n_embd, routing)
        self.experts = GroupedExperts(routing.n_experts, n_embd, hidden)
        self.shared = shared  # the shared experts (an MLP every token goes through), or None
        self.exchange: Exchange | None = None
        self.aux_scale = 1.0
        e = routing.n_experts
        self.register_buffer("step_tokens", torch.zeros(e, dtype=torch.float64), persistent=False)
        self.register_buffer("load", torch.zeros(e, dtype=torch.float64), persistent=False)
        self.register_buffer("aux_sums", torch.zeros(2, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        scores, chosen, weights = self.router(h)
        out = self._routed(h, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(h)
        out = out.view(b, t, d)
        if not self.training:
            return out
        aux = self._aux(scores.view(b, t, -1), chosen.view(b, t, -1))
        if torch._C._current_graph_task_id() == -1:  # not a checkpointed block's re-computation in backward
            self._count(chosen, aux, b)
        if self.routing.aux_weight > 0 and torch.is_grad_enabled():
            out = JoinLoss.apply(
                out, aux * (self.routing.aux_weight / self.routing.n_moe_blocks), self.aux_scale
            )
        return out

    def _routed(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's experts' outputs, weighted and summed (in the order of its choices)."""
        n, k = chosen.shape
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the token-expert pairs sorted by expert
        counts = torch.bincount(flat, minlength=self.routing.n_experts)
        xs = h[order // k]
        if self.exchange is None:
            ys = self.experts(xs, counts)
        else:  # to the ranks holding the experts and back
            xe, local_counts, ctx = self.exchange.dispatch(xs, counts)
            ys = self.exchange.combine(self.experts(xe, local_counts), ctx)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        ys = ys.index_select(0, back).view(n, k, -1)
        return (ys.float() * weights.unsqueeze(-1)).sum(1).to(h.dtype)

    def _aux(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The mean over the batch's sequences of E x sum_i f_i P_i (Switch's load-balancing loss of a sequence)."""
        e = self.routing.n_experts
        slots = chosen.shape[1] * chosen.shape[2]
        f = (
            torch.zeros(chosen.shape[0], e, device=scores.device).scatter_add_(
                1, chosen.flatten(1), torch.ones(chosen.shape[0], slots, device=scores.device)
            )
            / slots
        )
        if self.routing.score == "sigmoid":  # DeepSeek-V3 normalizes the sigmoid scores of a token first
            scores = scores / scores.sum(-1, keepdim=True)
        return (e * (f * scores.mean(1)).sum(-1)).mean()

    @torch.no_grad()
    def _count(self, chosen: torch.Tensor, aux: torch.Tensor, sequences: int) -> None:
        tokens = torch.bincount(chosen.flatten(), minlength=self.routing.n_experts).double()
        self.step_tokens += tokens
        self.load += tokens
        self.aux_sums += torch.stack([aux.detach().double() * sequences, aux.new_tensor(sequences).double()])


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE MLPs of `model` (or of a pipeline stage of it), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def init_std(n_layer: int) -> tuple[float, float]:
    """The normal init's std of the matrices, and of the residual projections (scaled by depth), as the Llama's."""
    return 0.02, 0.02 / math.sqrt(2 * n_layer)
