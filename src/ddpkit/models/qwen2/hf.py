"""Hugging Face's Qwen2 (Qwen2ForCausalLM) in and out of Qwen2, declared (models/hf/ reads and writes the folder and
asks the family's `HFConverter`, made of these): the Llama's config.json values and tensors (models/llama/hf.py)
and the biases of the query, key and value projections. Sliding-window attention in some of its layers
(`use_sliding_window`, which no released Qwen2 uses) is refused."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFTensor
from ddpkit.models.llama.hf import KEYS, ROPE_FIXED, full_attention_check, llama_ignored, llama_tensors

FIXED = (
    HFFixed("hidden_act", ("silu",), "another activation"),
    *ROPE_FIXED,
    HFFixed("use_sliding_window", (False,), "sliding-window attention"),
)


def qwen2_tensors(m: Any) -> dict[str, HFTensor]:
    """The Llama's tensors and the q, k and v biases (`m`: the model's keys, cfg.model or the model itself)."""
    out = llama_tensors(m)
    for i in range(m.n_layer):
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")):
            out[f"blocks.{i}.attn.{ours}.bias"] = HFTensor(f"model.layers.{i}.self_attn.{theirs}.bias")
    return out


def qwen2_extra(m: Any) -> dict[str, Any]:
    return full_attention_extra("Qwen2ForCausalLM", m)


def full_attention_extra(architecture: str, m: Any) -> dict[str, Any]:
    """config.json's values of a Qwen-style model whose every layer attends to the whole context."""
    return {
        "architectures": [architecture],
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default"},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.n_layer,
        "layer_types": ["full_attention"] * m.n_layer,
    }


CONVERTER = HFConverter(
    "qwen2",
    "Qwen2",
    keys=KEYS,
    fixed=FIXED,
    check=full_attention_check,
    tensors=qwen2_tensors,
    ignored=llama_ignored,
    extra=qwen2_extra,
)
