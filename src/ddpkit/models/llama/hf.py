"""Hugging Face's Llama (LlamaForCausalLM) in and out of the Llama, declared (models/hf/ reads and writes the
folder and asks the family's `HFConverter`, made of these): which config.json values are which config keys (each
checked by the key's own rules, each model.init_from's default), the values the Llama holds one way only, and
where each of its tensors lies in the folder."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFKey, HFTensor

# LlamaForCausalLM's names are the Llama's one for one: `model.embed_tokens` = `tok_emb`, `model.layers.N.input_layernorm/post_attention_layernorm`
# = `blocks.N.ln1/ln2`, `self_attn.q/k/v/o_proj` = `attn.wq/wk/wv/wo`, `mlp.gate/up/down_proj` = `mlp.gate/up/down`,
# `model.norm` = `ln_f`, `lm_head` = `head`.
LLAMA_PARTS = {
    "ln1": "input_layernorm",
    "ln2": "post_attention_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}

KEYS = (
    HFKey("data.vocab_size", "vocab_size"),
    # the longest context RoPE was trained for: a model of any data.block_size reads it (not the run's default)
    HFKey("data.block_size", "max_position_embeddings", default=2048, init=False),
    HFKey("model.n_layer", "num_hidden_layers"),
    HFKey("model.n_head", "num_attention_heads"),
    HFKey("model.n_embd", "hidden_size"),
    HFKey("model.n_kv_head", "num_key_value_heads", default=None),
    HFKey("model.ffn_hidden", "intermediate_size"),
    HFKey("model.head_dim", "head_dim", default=None),  # null or absent: hidden_size / num_attention_heads
    HFKey("model.rope_theta", ("rope_parameters.rope_theta", "rope_theta"), default=10000.0),
    HFKey("model.norm_eps", "rms_norm_eps", default=1e-6),
    HFKey("model.tie_embeddings", "tie_word_embeddings", default=False),
)
ROPE_FIXED = (  # the rotary embedding as the Llama-shaped families hold it: unscaled
    HFFixed("rope_parameters.rope_type", ("default",), "RoPE scaling"),
    HFFixed("rope_scaling", ({"rope_type": "default"}, {"type": "default"}), "RoPE scaling"),
)
FIXED = (
    HFFixed("hidden_act", ("silu",), "another activation"),
    HFFixed("attention_bias", (False,), "biases in the attention"),
    HFFixed("mlp_bias", (False,), "biases in the MLP"),
    *ROPE_FIXED,
)


def full_attention_check(raw: dict[str, Any], cfg: Any) -> str | None:
    """What else config.json asks (Qwen2's and Qwen3's): sliding-window attention in some layers (`layer_types`), which
    the family does not hold."""
    types = raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or set(types) - {"full_attention"}):
        return f"layer_types={types!r} asks for attention other than full attention in some layers"
    return None


def llama_ignored(m: Any) -> tuple[str, ...]:
    """Folder tensors that are not weights: RoPE's buffer of old folders; a stored lm_head where the head is tied
    (transformers ties it to the embedding and ignores it)."""
    return (r"\.rotary_emb\.inv_freq$", *((r"^lm_head\.weight$",) if m.tie_embeddings else ()))


def llama_tensors(m: Any) -> dict[str, HFTensor]:
    """The Llama's tensors in the folder (`m`: the model's keys, cfg.model or the model itself)."""
    out = {
        "tok_emb.weight": HFTensor("model.embed_tokens.weight"),
        "ln_f.weight": HFTensor("model.norm.weight"),
    }
    for i in range(m.n_layer):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"blocks.{i}.{ours}.weight"] = HFTensor(f"model.layers.{i}.{theirs}.weight")
    out["head.weight"] = HFTensor("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")
    return out


def llama_extra(m: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
    }


CONVERTER = HFConverter(
    "llama",
    "Llama",
    keys=KEYS,
    fixed=FIXED,
    tensors=llama_tensors,
    ignored=llama_ignored,
    extra=llama_extra,
)
