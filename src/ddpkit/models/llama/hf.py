"""Hugging Face's Llama (LlamaForCausalLM) in and out of the Llama: its config.json and its tensors' names (models/hf.py
reads and writes the folder and asks the family's `HFConverter`, made of these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.models.hf import need, refuse

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


def llama_shape(cfg: dict, folder: Path) -> dict[str, Any]:
    """The Llama's constructor arguments for a Llama config.json; UserError for what it cannot hold."""
    n_embd, n_head = need(cfg, "hidden_size", folder), need(cfg, "num_attention_heads", folder)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    refuse(
        [
            (cfg.get("hidden_act", "silu") != "silu", f"hidden_act={cfg.get('hidden_act')}"),
            (cfg.get("attention_bias") or cfg.get("mlp_bias"), "biases (attention_bias or mlp_bias)"),
            (kind != "default", f"RoPE scaling {kind!r}"),
            (not isinstance(theta, int | float) or theta <= 0, f"rope_theta={theta}"),
            (cfg.get("head_dim", n_embd // n_head) * n_head != n_embd, f"head_dim={cfg.get('head_dim')}"),
        ],
        folder,
        "Llama",
    )
    return {
        "vocab_size": need(cfg, "vocab_size", folder),
        "block_size": need(cfg, "max_position_embeddings", folder),
        "n_layer": need(cfg, "num_hidden_layers", folder),
        "n_head": n_head,
        "n_embd": n_embd,
        "n_kv_head": cfg.get("num_key_value_heads") or n_head,
        "ffn_hidden": need(cfg, "intermediate_size", folder),
        "rope_theta": float(theta),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def llama_to_ours(hf: dict[str, torch.Tensor], shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {"tok_emb.weight": hf["model.embed_tokens.weight"], "ln_f.weight": hf["model.norm.weight"]}
    for i in range(shape["n_layer"]):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"blocks.{i}.{ours}.weight"] = hf[f"model.layers.{i}.{theirs}.weight"]
    out["head.weight"] = out["tok_emb.weight"] if shape["tie_embeddings"] else hf["lm_head.weight"]
    return out


def ours_to_llama(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(model.n_layer):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"blocks.{i}.{ours}.weight"]
    if not model.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


def llama_config(m: nn.Module) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.block_size,
        "hidden_size": m.n_embd,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "num_key_value_heads": m.n_kv_head,
        "head_dim": m.n_embd // m.n_head,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(m.tie_embeddings),
    }
