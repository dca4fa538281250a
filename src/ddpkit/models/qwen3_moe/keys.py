"""The Qwen3-MoE family's card, torch-free: the Mixtral family's keys (the Llama's and the routed experts')."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import MoEKeys, TransformerKeys
from ddpkit.models.llama.keys import LlamaKeys

CARD = FamilyCard(
    "qwen3_moe",
    "qwen3_moe (the Mixtral-shaped decoder with Qwen3's norms of the query and key heads, Qwen3-MoE's shape)",
    keys=(TransformerKeys, LlamaKeys, MoEKeys),
    owns=lambda arch: arch == "qwen3_moe",
    tokens=True,
)
