"""Qwen2's card, torch-free: the Llama's keys (the family is the Llama with q, k and v biases)."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import TransformerKeys
from ddpkit.models.llama.keys import LlamaKeys

CARD = FamilyCard(
    "qwen2",
    "qwen2 (the Llama-style decoder with biases on the query, key and value projections: Qwen2's)",
    keys=(TransformerKeys, LlamaKeys),
    owns=lambda arch: arch == "qwen2",
    tokens=True,
)
