"""Qwen3's model and family: the Llama (models/llama/model.py) with an RMSNorm of each query and key head before the
rotation, as transformers' Qwen3ForCausalLM; every parallel fact, check and estimate is the Llama's (the per-head
norms replicated over the heads a rank holds under tensor parallelism)."""

from __future__ import annotations

from typing import Any

from ddpkit.models.llama.model import Llama, llama_shaped
from ddpkit.models.qwen3 import hf
from ddpkit.models.qwen3.keys import CARD


class Qwen3(Llama):
    """The Llama with q and k norms."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, qk_norm=True, **kwargs)


FAMILY = llama_shaped(CARD, Qwen3, hf.CONVERTER, order=330)
