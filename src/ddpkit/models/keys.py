"""What the built-in decoder families (gpt/, llama/, and a family of your own shaped like them) share without torch:
their size keys, the check that the width fits the heads, and the activations one micro-batch keeps; and the routed
experts' keys of a mixture-of-experts family (mixtral/, or one of your own built on models/experts.py) and their
checks. Each family's own keys sit in its folder's keys.py; the families name the key sets they own
(`FamilyCard.keys`), and a key set two families own is documented under both names (config/declared.py). A family
of your own declares its keys the same way: a dataclass of `opt()` fields in `ModelFamily.keys`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ddpkit.config.schema import opt
from ddpkit.errors import UserError


@dataclass
class TransformerKeys:
    """the decoder's size, dropout, weight tying and Hugging Face starting point."""

    n_layer: int = opt(4, "transformer blocks", gt=0, le=1024)
    n_head: int = opt(4, "attention (query) heads per block (n_embd must be a multiple)", gt=0, le=1024)
    n_embd: int = opt(128, "embedding width", gt=0, le=65536)
    dropout: float = opt(0.0, "dropout probability (0: deterministic, equal on every layout)", ge=0, lt=1)
    tie_embeddings: bool = opt(
        False, "the head shares the token embedding's weight (GPT-2's); not with dist.tp or dist.pp"
    )
    init_from: str | None = opt(
        None,
        "start from a Hugging Face folder (config.json + model.safetensors, or a sharded index) of an "
        "architecture a family reads; every model shape key left unset (model.arch, sizes, heads, norm eps, "
        "rope theta, tied head, data.vocab_size) is its config.json's, and one set otherwise is refused",
    )


def check_heads(m: Any) -> None:
    """The width fits the heads (ModelFamily.check_keys)."""
    if m.n_embd % m.n_head:
        raise UserError(
            f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}",
            "pick n_embd = n_head x the width of one head",
        )


def activation_bytes(n_layer: int, n_head: int, n_embd: int, block_size: int, batch: int) -> int:
    """The bytes of activations one micro-batch of a decoder keeps for backward: per block batch x block x
    n_embd x (34 + 5 x n_head x block / n_embd) half-precision bytes (Korthikanti et al., 2022), doubled for
    float32."""
    per_block = batch * block_size * n_embd * (34 + 5 * n_head * block_size / n_embd)
    return int(2 * n_layer * per_block)


# ------------------------------------------------------------------------------------------- routed experts

# the auxiliary loss's weight when model.moe_aux_loss is null, by model.moe_balance
AUX_DEFAULT = {"aux": 0.01, "bias": 0.0}


@dataclass
class MoEKeys:
    """routed experts, dropless token-choice routing and what evens their load (model.arch=llama with model.n_experts is Mixtral-shaped)."""

    n_experts: int | None = opt(
        None, "routed experts in each mixture-of-experts block; null or 0: a dense model", ge=0, le=4096
    )
    experts_per_token: int = opt(2, "experts each token is routed to (token-choice top-k)", gt=0, le=64)
    n_shared_experts: int = opt(
        0,
        "experts every token goes through besides its routed ones (DeepSeek's shared experts: one SwiGLU as "
        "wide as this many experts)",
        ge=0,
        le=64,
    )
    moe_every: int = opt(
        1,
        "every Nth block is a mixture-of-experts block (block i when (i + 1) is a multiple of N), the others "
        "dense SwiGLUs of model.ffn_hidden",
        gt=0,
    )
    moe_ffn_hidden: int | None = opt(None, "each expert's SwiGLU width; null: model.ffn_hidden's", gt=0)
    moe_score: Literal["softmax", "sigmoid"] = opt(
        "softmax",
        "the router's scores: softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid per expert "
        "(DeepSeek-V3)",
    )
    moe_norm_topk: bool = opt(
        True, "the chosen experts' weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)"
    )
    moe_balance: Literal["aux", "bias"] = opt(
        "aux",
        "what evens the experts' load: aux (the auxiliary loss, model.moe_aux_loss) or bias (DeepSeek-V3's "
        "auxiliary-loss-free balancing: a per-expert bias on the scores that choose the experts, moved by "
        "model.moe_bias_rate after every optimizer step towards the experts that got fewer tokens)",
    )
    moe_aux_loss: float | None = opt(
        None,
        "the load-balancing loss's weight (Switch/Mixtral: E x sum_i f_i P_i of each sequence, 1 when "
        "balanced; added to the loss); 0: off; null: 0.01 with moe_balance=aux, 0 with bias",
        ge=0,
        le=100,
    )
    moe_bias_rate: float = opt(
        0.001,
        "moe_balance=bias: how far one optimizer step moves an expert's bias (DeepSeek-V3's gamma)",
        gt=0,
        le=1,
    )


def n_experts(m: Any) -> int:
    """The routed experts of each mixture-of-experts block of `m` (cfg.model); 0 for a dense model."""
    return getattr(m, "n_experts", None) or 0


def aux_weight(m: Any) -> float:
    """model.moe_aux_loss, its null resolved by model.moe_balance."""
    return AUX_DEFAULT[m.moe_balance] if m.moe_aux_loss is None else float(m.moe_aux_loss)


def check_moe_keys(m: Any) -> None:
    """The expert keys fit together (ModelFamily.check_keys of a mixture-of-experts family)."""
    e = n_experts(m)
    if e == 0:
        raise UserError(
            f"model.arch={m.arch} is a mixture of experts: it needs model.n_experts",
            "set model.n_experts=8, say",
        )
    if m.experts_per_token > e:
        raise UserError(
            f"model.experts_per_token={m.experts_per_token} is more than the model.n_experts={e} experts",
            f"use a model.experts_per_token of at most {e}",
        )
    if m.moe_every > m.n_layer:
        raise UserError(
            f"model.moe_every={m.moe_every} leaves the model.n_layer={m.n_layer} blocks without experts",
            f"use a model.moe_every of at most {m.n_layer}",
        )


def moe_blocks(n_layer: int, every: int) -> list[int]:
    """The blocks that are mixture-of-experts blocks: i with (i + 1) a multiple of `every` (Qwen-MoE's
    decoder_sparse_step)."""
    return [i for i in range(n_layer) if (i + 1) % every == 0]


def expert_width(m: Any, dense_width: int) -> int:
    """Each expert's SwiGLU width: model.moe_ffn_hidden, or the dense MLP's."""
    return m.moe_ffn_hidden or dense_width
