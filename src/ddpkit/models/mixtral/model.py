"""The Mixtral-shaped decoder (`model.arch=mixtral`, and `model.arch=llama` with model.n_experts): the Llama with
routed experts (models/experts.py) as the MLP of every model.moe_every-th block, and its family. `ExpertLlama` and
the family facts here are what a mixture-of-experts family of the Llama's shape shares (Qwen3-MoE's subclasses
it, its attention's options fixed): the builder, the parallel facts (the Llama's stack without sequence
parallelism, the shared experts split as a dense MLP; the routed experts split over dist.ep by
parallel/experts/), the FLOPs of the experts a token goes through, the size estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ddpkit.models.blocks import BlockStack
from ddpkit.models.experts import MoE, Routing, init_experts, init_std, moe_layers
from ddpkit.models.family import ModelFamily, images_refused
from ddpkit.models.flops import decoder_flops
from ddpkit.models.keys import activation_bytes, check_moe_keys, expert_width, moe_blocks, n_experts
from ddpkit.models.llama.model import Llama, SwiGLU, check_keys, swiglu_width
from ddpkit.models.mixtral import hf
from ddpkit.models.mixtral.keys import CARD


class ExpertLlama(Llama):
    """The Llama whose every `moe_every`-th block's MLP is a mixture of experts (`routing`: how it routes), each
    expert a SwiGLU of width `moe_ffn_hidden` (default: ffn_hidden), with `n_shared_experts` experts' width of
    shared experts beside; the other blocks keep the dense SwiGLU."""

    def __init__(
        self,
        *args: Any,
        routing: Routing,
        moe_every: int = 1,
        moe_ffn_hidden: int | None = None,
        n_shared_experts: int = 0,
        **kwargs: Any,
    ):
        """The Llama's arguments, and the experts': how they route, which blocks hold them, their width and the
        shared experts'."""
        # what block() reads, set before the Llama makes its blocks
        self.routing, self.moe_every, self.n_shared_experts = routing, moe_every, n_shared_experts
        self.expert_width = moe_ffn_hidden
        super().__init__(*args, **kwargs)
        std, out_std = init_std(self.n_layer)  # the Llama initialised the matrices; the experts' are 3-D
        for moe in moe_layers(self):
            init_experts(moe.experts, std, out_std)

    @property
    def moe_ffn_hidden(self) -> int:
        """Each expert's SwiGLU width (model.moe_ffn_hidden, or the dense one's)."""
        return self.expert_width or self.ffn_hidden

    @property
    def n_experts(self) -> int:
        return self.routing.n_experts

    @property
    def experts_per_token(self) -> int:
        return self.routing.top_k

    @property
    def moe_score(self) -> str:
        return self.routing.score

    @property
    def moe_norm_topk(self) -> bool:
        return self.routing.norm_topk

    @property
    def moe_balance(self) -> str:
        return "bias" if self.routing.bias else "aux"

    def block(self, i: int, mlp: nn.Module | None = None) -> nn.Module:
        if mlp is None and i in moe_blocks(self.n_layer, self.moe_every):
            width = self.moe_ffn_hidden
            shared = SwiGLU(self.n_embd, self.n_shared_experts * width) if self.n_shared_experts else None
            mlp = MoE(self.n_embd, width, self.routing, shared)
        return super().block(i, mlp)


def builder(model: type[ExpertLlama], **fixed: Any) -> Callable[[str, int, int, Any], nn.Module]:
    """ModelFamily.build_lm of a mixture-of-experts family: `model` of the config's keys, with the attention
    options `fixed` (Qwen3-MoE's norms of the query and key heads)."""

    def build(arch: str, vocab_size: int, block_size: int, m: Any) -> nn.Module:
        return model(
            vocab_size, block_size, m.n_layer, m.n_head, m.n_embd, n_kv_head=m.n_kv_head,
            ffn_hidden=m.ffn_hidden, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings, dropout=m.dropout, head_dim=m.head_dim, routing=Routing.of(m),
            moe_every=m.moe_every,
            moe_ffn_hidden=m.moe_ffn_hidden, n_shared_experts=m.n_shared_experts, **fixed,
        )  # fmt: skip

    return build


# the Llama's parallel facts, and the shared experts split as its dense MLP; the routed experts are left whole by
# tensor parallelism (expert parallelism splits them), so a block takes whole sequences (no sequence parallelism)
STACK = BlockStack(
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up", "mlp.shared.gate", "mlp.shared.up"),
    row=("attn.wo", "mlp.down", "mlp.shared.down"),
    head_norms=("attn.q_norm", "attn.k_norm"),
    tp_keys=("model.n_head", "model.n_embd", "model.n_kv_head"),
    sp_keys=(),
    sequence_parallel=False,
)


def check_expert_keys(m: Any) -> None:
    """The Llama's keys and the experts' fit together (ModelFamily.check_keys)."""
    check_keys(m)
    check_moe_keys(m)


def active_flops(model: nn.Module, block_size: int) -> int | None:
    """6 N + 12 L d T with N the parameters a token goes through: the experts it is not routed to left out."""
    flops = decoder_flops(model, block_size)
    if flops is None:
        return None
    idle = 0
    for moe in moe_layers(model):
        r = moe.routing
        idle += sum(p.numel() for p in moe.experts.parameters()) * (r.n_experts - r.top_k) // r.n_experts
    return flops - 6 * idle


def estimate(m: Any, block_size: int, batch: int) -> tuple[int, int]:
    """(parameters, activation bytes) before building (ModelFamily.estimate): the attention's projections, the
    dense SwiGLUs, each MoE block's experts, shared experts and router, the norms."""
    head = m.head_dim or m.n_embd // max(1, m.n_head)
    q, kv = m.n_head * head, (m.n_kv_head or m.n_head) * head
    dense = swiglu_width(m.n_embd, m.ffn_hidden)
    width = expert_width(m, dense)
    moe = len(moe_blocks(m.n_layer, m.moe_every))
    attention = 2 * m.n_embd * q + 2 * m.n_embd * kv + 2 * m.n_embd
    experts = 3 * m.n_embd * width * (n_experts(m) + m.n_shared_experts) + n_experts(m) * m.n_embd
    params = m.n_layer * attention + (m.n_layer - moe) * 3 * m.n_embd * dense + moe * experts + m.n_embd
    return params, activation_bytes(m.n_layer, m.n_head, m.n_embd, block_size, batch)


def family_fields(model: type[ExpertLlama], **fixed: Any) -> dict[str, Any]:
    """The ModelFamily fields a mixture-of-experts family of `model` shares with the others."""
    return {
        "build_lm": builder(model, **fixed),
        "module_types": (model,),
        **STACK.family_fields(),
        "check_keys": check_expert_keys,
        "estimate": estimate,
        "flops_per_token": active_flops,
        "routed_experts": n_experts,
    }


class Mixtral(ExpertLlama):
    """Mixtral's shape: the Llama's attention, routed experts (and optional shared experts)."""


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=images_refused,
    names=lambda: [CARD.name],
    **family_fields(Mixtral),
    hf=hf.CONVERTER,
    order=310,
)
