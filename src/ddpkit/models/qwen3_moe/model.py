"""Qwen3-MoE's shape: the Mixtral-shaped Llama (models/mixtral/model.py, whose family facts it shares) with an
RMSNorm of each query and key head before the rotation, and its family."""

from __future__ import annotations

from ddpkit.models.family import ModelFamily, images_refused
from ddpkit.models.mixtral.model import ExpertLlama, family_fields
from ddpkit.models.qwen3_moe import hf
from ddpkit.models.qwen3_moe.keys import CARD


class Qwen3Moe(ExpertLlama):
    """The Mixtral-shaped Llama whose attention normalizes each query and key head (Qwen3's)."""


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=images_refused,
    names=lambda: [CARD.name],
    **family_fields(Qwen3Moe, qk_norm=True),
    hf=hf.CONVERTER,
    order=320,
)
