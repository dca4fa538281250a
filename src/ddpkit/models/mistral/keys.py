"""Mistral's card and its own key, torch-free: the Llama's keys and the sliding window of its attention."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.config.schema import opt
from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import TransformerKeys
from ddpkit.models.llama.keys import LlamaKeys


@dataclass
class MistralKeys:
    """Mistral's sliding-window attention."""

    sliding_window: int | None = opt(
        None,
        "each position attends to the last sliding_window positions, its own included (transformers' "
        "sliding-window mask); null: to every position before it",
        gt=0,
    )


CARD = FamilyCard(
    "mistral",
    "mistral (the Llama-style decoder with sliding-window attention, model.sliding_window: Mistral's)",
    keys=(TransformerKeys, LlamaKeys, MistralKeys),
    owns=lambda arch: arch == "mistral",
    tokens=True,
)
