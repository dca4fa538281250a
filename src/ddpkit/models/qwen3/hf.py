"""Hugging Face's Qwen3 (Qwen3ForCausalLM) in and out of Qwen3, declared (models/hf/ reads and writes the folder and
asks the family's `HFConverter`, made of these): the Llama's config.json values and tensors (models/llama/hf.py),
`head_dim` read as Qwen3Config reads it (128 where config.json does not say), and the RMSNorm of each query and key
head. Biases in the attention (`attention_bias`) and sliding-window attention in some of its layers are refused."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFKey, HFTensor
from ddpkit.models.llama.hf import KEYS, ROPE_FIXED, full_attention_check, llama_ignored, llama_tensors
from ddpkit.models.qwen2.hf import full_attention_extra

# Qwen3Config's head_dim is 128 unless config.json says otherwise (not hidden_size / num_attention_heads)
QWEN3_KEYS = tuple(HFKey(k.key, k.name, default=128) if k.key == "model.head_dim" else k for k in KEYS)
FIXED = (
    HFFixed("hidden_act", ("silu",), "another activation"),
    HFFixed("attention_bias", (False,), "biases in the attention"),
    *ROPE_FIXED,
    HFFixed("use_sliding_window", (False,), "sliding-window attention"),
)


def qwen3_tensors(m: Any) -> dict[str, HFTensor]:
    """The Llama's tensors and the per-head q and k norms (`m`: the model's keys, cfg.model or the model)."""
    out = llama_tensors(m)
    for i in range(m.n_layer):
        for norm in ("q_norm", "k_norm"):
            out[f"blocks.{i}.attn.{norm}.weight"] = HFTensor(f"model.layers.{i}.self_attn.{norm}.weight")
    return out


def qwen3_extra(m: Any) -> dict[str, Any]:
    return {**full_attention_extra("Qwen3ForCausalLM", m), "attention_bias": False}


CONVERTER = HFConverter(
    "qwen3",
    "Qwen3",
    keys=QWEN3_KEYS,
    fixed=FIXED,
    check=full_attention_check,
    tensors=qwen3_tensors,
    ignored=llama_ignored,
    extra=qwen3_extra,
)
