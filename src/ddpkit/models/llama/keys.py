"""The Llama's card and its own config keys, torch-free: read when a config loads and while the workers start."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.config.schema import opt
from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import TransformerKeys


@dataclass
class LlamaKeys:
    """the Llama-style decoder's grouped-query attention, SwiGLU width, rotary embeddings and RMSNorm."""

    n_kv_head: int | None = opt(
        None, "key/value heads, each serving n_head / n_kv_head query heads; null: n_head", gt=0
    )
    ffn_hidden: int | None = opt(
        None, "the SwiGLU MLP's width; null: 8 x n_embd / 3 rounded up to a multiple of 8", gt=0
    )
    head_dim: int | None = opt(
        None,
        "the width of one attention head (the queries' n_head x head_dim need not be n_embd); null: n_embd / n_head",
        gt=0,
    )
    rope_theta: float = opt(10000.0, "the base of the rotary position embeddings", gt=0)
    norm_eps: float = opt(1e-5, "the RMSNorm epsilon", gt=0, lt=1)


CARD = FamilyCard(
    "llama",
    "llama (the built-in Llama-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention)",
    keys=(TransformerKeys, LlamaKeys),
    owns=lambda arch: arch == "llama",
    tokens=True,
)
