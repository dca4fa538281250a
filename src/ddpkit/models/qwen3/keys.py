"""Qwen3's card, torch-free: the Llama's keys (the family is the Llama with an RMSNorm of each query and key head)."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import TransformerKeys
from ddpkit.models.llama.keys import LlamaKeys

CARD = FamilyCard(
    "qwen3",
    "qwen3 (the Llama-style decoder with an RMSNorm of each query and key head: Qwen3's)",
    keys=(TransformerKeys, LlamaKeys),
    owns=lambda arch: arch == "qwen3",
    tokens=True,
)
