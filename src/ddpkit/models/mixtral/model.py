"""The Mixtral-shaped decoder (`model.arch=mixtral`, and `model.arch=llama` with model.n_experts): the Llama with
routed experts in every model.moe_every-th block (models/moe/decoder.py), and its family."""

from __future__ import annotations

from ddpkit.models.family import ModelFamily, images_refused
from ddpkit.models.mixtral.keys import CARD
from ddpkit.models.moe.decoder import ExpertLlama, family_fields


class Mixtral(ExpertLlama):
    """Mixtral's shape: the Llama's attention, routed experts (and optional shared experts)."""


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=images_refused,
    names=lambda: [CARD.name],
    **family_fields(Mixtral),
    order=310,
)
