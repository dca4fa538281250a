"""The GPT's card and its own config keys, torch-free: read when a config loads and while the workers start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpkit.config.schema import opt
from ddpkit.models.family import FamilyCard
from ddpkit.models.keys import TransformerKeys


@dataclass
class GPTKeys:
    """the GPT-2-style decoder's MLP."""

    gelu_approximate: Literal["none", "tanh"] = opt(
        "none", "the MLP's GELU, exact (none) or the tanh approximation GPT-2 uses"
    )


CARD = FamilyCard(
    "gpt",
    "gpt (the built-in GPT-2-style decoder, for data.dataset=text or tokens)",
    keys=(TransformerKeys, GPTKeys),
    owns=lambda arch: arch == "gpt",
    tokens=True,
)
