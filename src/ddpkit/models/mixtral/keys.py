"""The Mixtral family's card, torch-free: its keys are the Llama's and the routed experts' (models/keys.py); it
builds model.arch=mixtral and model.arch=llama with model.n_experts set."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import MoEKeys, TransformerKeys, n_experts
from ddpkit.models.llama.keys import LlamaKeys


def claims(arch: str, m: Any) -> bool:
    """model.arch=llama with routed experts is a Mixtral-shaped model."""
    return arch == "llama" and n_experts(m) > 0


CARD = FamilyCard(
    "mixtral",
    "mixtral (the Llama-style decoder with routed experts, Mixtral's shape; also model.arch=llama with "
    "model.n_experts)",
    keys=(TransformerKeys, LlamaKeys, MoEKeys),
    owns=lambda arch: arch == "mixtral",
    tokens=True,
    claims=claims,
)
