"""Hugging Face's GPT-2 (GPT2LMHeadModel) in and out of the GPT: its config.json and its tensors' names and shapes
(models/hf.py reads and writes the folder and asks the family's `HFConverter`, made of these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.models.hf import need, refuse

# GPT2LMHeadModel's names and shapes against the GPT's: `transformer.wte` = `tok_emb`, `wpe` = `pos_emb`, `h.N.ln_1/ln_2` = `blocks.N.ln1/ln2`,
# `h.N.attn.c_attn` (a Conv1D: weight (in, 3 x out), q|k|v side by side) = `wq`, `wk`, `wv` (Linear: weight
# (out, in)), `attn.c_proj` = `wo`, `mlp.c_fc` = `mlp.fc`, `mlp.c_proj` = `mlp.proj`, `ln_f` = `ln_f`, `lm_head` =
# `head` (tied to `wte` unless tie_word_embeddings is false).
GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": None, "gelu": "none"}


def gpt2_shape(cfg: dict, folder: Path) -> dict[str, Any]:
    """The GPT's constructor arguments for a GPT-2 config.json; UserError for what the GPT cannot hold."""
    n_embd = need(cfg, "n_embd", folder)
    act = GELU.get(cfg.get("activation_function", "gelu_new"))
    unsupported = [
        (act is None, f"activation_function={cfg.get('activation_function')}"),
        (cfg.get("n_inner") not in (None, 4 * n_embd), f"n_inner={cfg.get('n_inner')} (not 4 x n_embd)"),
        (cfg.get("layer_norm_epsilon", 1e-5) != 1e-5, f"layer_norm_epsilon={cfg.get('layer_norm_epsilon')}"),
        (cfg.get("scale_attn_weights", True) is not True, "scale_attn_weights=false"),
        (cfg.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true"),
    ]
    refuse(unsupported, folder, "GPT")
    return {
        "vocab_size": need(cfg, "vocab_size", folder),
        "block_size": need(cfg, "n_positions", folder),
        "n_layer": need(cfg, "n_layer", folder),
        "n_head": need(cfg, "n_head", folder),
        "n_embd": n_embd,
        "gelu_approximate": act,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _gpt2_pairs(n_layer: int):
    """(our name, GPT2LMHeadModel's name, stored transposed) of every tensor but the fused q|k|v and the head."""
    t = "transformer."
    yield "tok_emb.weight", f"{t}wte.weight", False
    yield "pos_emb.weight", f"{t}wpe.weight", False
    for part in ("weight", "bias"):
        yield f"ln_f.{part}", f"{t}ln_f.{part}", False
    for i in range(n_layer):
        h, b = f"{t}h.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            yield f"{b}ln1.{part}", f"{h}ln_1.{part}", False
            yield f"{b}ln2.{part}", f"{h}ln_2.{part}", False
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            yield f"{b}{ours}.weight", f"{h}{theirs}.weight", True  # Conv1D: weight (in, out)
            yield f"{b}{ours}.bias", f"{h}{theirs}.bias", False


def gpt2_to_gpt(hf: dict[str, torch.Tensor], shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel's (or GPT2Model's) tensors under the GPT's names."""
    n_layer = shape["n_layer"]
    hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf.items()}
    out = {ours: hf[theirs].t() if flip else hf[theirs] for ours, theirs, flip in _gpt2_pairs(n_layer)}
    for i in range(n_layer):
        h, b = f"transformer.h.{i}.attn.c_attn.", f"blocks.{i}.attn."
        w, bias = hf[h + "weight"].t(), hf[h + "bias"]  # q|k|v side by side
        for name, wp, bp in zip(("wq", "wk", "wv"), w.chunk(3, 0), bias.chunk(3, 0), strict=True):
            out[f"{b}{name}.weight"], out[f"{b}{name}.bias"] = wp, bp
    out["head.weight"] = out["tok_emb.weight"] if shape["tie_embeddings"] else hf["lm_head.weight"]
    return out


def gpt_to_gpt2(model: nn.Module) -> dict[str, torch.Tensor]:
    """The GPT's state dict under GPT2LMHeadModel's names (the inverse of gpt2_to_gpt)."""
    sd = model.state_dict()
    out = {theirs: sd[ours].t() if flip else sd[ours] for ours, theirs, flip in _gpt2_pairs(model.n_layer)}
    for i in range(model.n_layer):
        h, b = f"transformer.h.{i}.attn.c_attn.", f"blocks.{i}.attn."
        out[h + "weight"] = torch.cat([sd[f"{b}{n}.weight"] for n in ("wq", "wk", "wv")], 0).t()
        out[h + "bias"] = torch.cat([sd[f"{b}{n}.bias"] for n in ("wq", "wk", "wv")], 0)
    if not model.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


def gpt2_config(m: nn.Module) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.block_size,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": None,
        "activation_function": "gelu_new" if m.gelu_approximate == "tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(m.tie_embeddings),
    }
