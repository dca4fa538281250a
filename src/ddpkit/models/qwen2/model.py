"""Qwen2's model and family: the Llama (models/llama/model.py) with biases on its query, key and value projections,
as transformers' Qwen2ForCausalLM; every parallel fact, check and estimate is the Llama's."""

from __future__ import annotations

from typing import Any

from ddpkit.models.llama.model import Llama, llama_shaped
from ddpkit.models.qwen2 import hf
from ddpkit.models.qwen2.keys import CARD


class Qwen2(Llama):
    """The Llama with q, k and v biases."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, qkv_bias=True, **kwargs)


FAMILY = llama_shaped(CARD, Qwen2, hf.CONVERTER, order=320)
