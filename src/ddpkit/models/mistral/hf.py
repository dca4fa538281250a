"""Hugging Face's Mistral (MistralForCausalLM) in and out of Mistral, declared (models/hf/ reads and writes the folder
and asks the family's `HFConverter`, made of these): the Llama's config.json values and tensors
(models/llama/hf.py) and `sliding_window` (model.sliding_window; null: no window). A config.json without
`sliding_window` is refused: MistralConfig would take 4096 there, a window nothing in the folder states."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFKey
from ddpkit.models.llama.hf import KEYS, ROPE_FIXED, llama_ignored, llama_tensors

MISTRAL_KEYS = (*KEYS, HFKey("model.sliding_window", "sliding_window", default=None))
FIXED = (HFFixed("hidden_act", ("silu",), "another activation"), *ROPE_FIXED)


def mistral_check(raw: dict[str, Any], cfg: Any) -> str | None:
    """What else config.json asks: a window it does not state (MistralConfig's default, 4096)."""
    if "sliding_window" not in raw:
        return "has no sliding_window (MistralConfig would take 4096): give the window, or null for none"
    return None


def mistral_extra(m: Any) -> dict[str, Any]:
    return {
        "architectures": ["MistralForCausalLM"],
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default"},
    }


CONVERTER = HFConverter(
    "mistral",
    "Mistral",
    keys=MISTRAL_KEYS,
    fixed=FIXED,
    check=mistral_check,
    tensors=llama_tensors,
    ignored=llama_ignored,
    extra=mistral_extra,
)
