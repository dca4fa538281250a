"""Mistral's model and family: the Llama (models/llama/model.py) with sliding-window attention (model.sliding_window),
as transformers' MistralForCausalLM; every parallel fact, check and estimate is the Llama's."""

from __future__ import annotations

from ddpkit.models.llama.model import Llama, llama_shaped
from ddpkit.models.mistral import hf
from ddpkit.models.mistral.keys import CARD


class Mistral(Llama):
    """The Llama whose attention may slide (`sliding_window`)."""


FAMILY = llama_shaped(CARD, Mistral, hf.CONVERTER, order=340, windowed=True)
