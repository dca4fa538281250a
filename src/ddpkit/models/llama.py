"""The built-in Llama-style decoder (`model.arch=llama`, its family at the end): rotary position embeddings (RoPE,
base model.rope_theta), RMSNorm, a SwiGLU MLP and grouped-query attention (model.n_kv_head key/value heads shared
by groups of the model.n_head query heads), no biases; the head tied to the token embedding when
model.tie_embeddings. It holds the Llama architecture of Hugging Face transformers exactly (its `HFConverter`
at the end maps the names).

Shaped like the GPT (models/gpt.py) for the parallel layouts: separate `wq`, `wk`, `wv`, `wo` and `gate`, `up`,
`down` projections (column- and row-parallel), heads counted from the tensor a rank gets, blocks in a ModuleDict
keyed "0", "1", ..., and `forward` skipping a part set to None.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.errors import UserError
from ddpkit.models.blocks import BlockStack
from ddpkit.models.family import HFConverter, ModelFamily
from ddpkit.models.gpt import _no_images, check_heads
from ddpkit.models.gpt import estimate as gpt_estimate
from ddpkit.models.hf import need, refuse
from ddpkit.models.keys import BUILTIN_KEYS


def swiglu_width(n_embd: int, given: int | None) -> int:
    """The SwiGLU's width: `given`, or Llama's rule (2/3 of 4 x n_embd, rounded up to a multiple of 8)."""
    if given is not None:
        return given
    return 8 * math.ceil(int(8 * n_embd / 3) / 8)


def rope(t: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of positions 0..t-1, each (t, head_dim), in float32 (Hugging Face Llama's layout: the two halves
    of a head rotate together)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, theta: float, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head or n_head % n_kv_head:
            raise ValueError(
                f"n_embd ({n_embd}) % n_head ({n_head}) and n_head % n_kv_head ({n_kv_head}) must be 0"
            )
        self.head_dim, self.group, self.theta = n_embd // n_head, n_head // n_kv_head, theta
        self.wq = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(n_head * self.head_dim, n_embd, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1: the heads this rank holds (all, or n_head / tp and n_kv_head / tp under tensor parallelism)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope(t, self.head_dim, self.theta, x.device)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        if self.group > 1:  # grouped-query attention: each key/value head serves `group` query heads
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x))."""

    def __init__(self, n_embd, n_head, n_kv_head, hidden, theta, eps, dropout=0.0):
        super().__init__()
        self.ln1 = nn.RMSNorm(n_embd, eps=eps)
        self.attn = Attention(n_embd, n_head, n_kv_head, theta, dropout)
        self.ln2 = nn.RMSNorm(n_embd, eps=eps)
        self.mlp = SwiGLU(n_embd, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size); a pipeline stage may hold only some of the parts."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        n_kv_head: int | None = None,
        ffn_hidden: int | None = None,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        tie_embeddings: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        n_kv_head = n_kv_head or n_head
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd, self.n_kv_head = n_layer, n_head, n_embd, n_kv_head
        self.ffn_hidden = swiglu_width(n_embd, ffn_hidden)
        self.rope_theta, self.norm_eps, self.tie_embeddings = rope_theta, norm_eps, tie_embeddings
        self.tok_emb: nn.Module | None = nn.Embedding(vocab_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict(
            {
                str(i): Block(n_embd, n_head, n_kv_head, self.ffn_hidden, rope_theta, norm_eps, dropout)
                for i in range(n_layer)
            }
        )
        self.ln_f: nn.Module | None = nn.RMSNorm(n_embd, eps=norm_eps)
        self.head: nn.Module | None = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual projections scaled by depth, as the GPT's
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("wo.weight", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.drop(self.tok_emb(x))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x


def _build_llama(arch: str, vocab_size: int, block_size: int, m: Any) -> nn.Module:
    return Llama(
        vocab_size,
        block_size,
        m.n_layer,
        m.n_head,
        m.n_embd,
        n_kv_head=m.n_kv_head,
        ffn_hidden=m.ffn_hidden,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings,
        dropout=m.dropout,
    )


# Hugging Face's Llama (LlamaForCausalLM) in and out (models/hf.py reads and writes the folder); its names are the
# Llama's one for one: `model.embed_tokens` = `tok_emb`, `model.layers.N.input_layernorm/post_attention_layernorm`
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


def ours_to_llama(model: Llama) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(model.n_layer):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"blocks.{i}.{ours}.weight"]
    if not model.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


def llama_config(m: Llama) -> dict[str, Any]:
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


# its parallel facts: as the GPT's, the SwiGLU's gate and up column-parallel and its down row-parallel, the
# key/value heads split over dist.tp too
STACK = BlockStack(
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up"),
    row=("attn.wo", "mlp.down"),
    tp_keys=("model.n_head", "model.n_embd", "model.n_kv_head"),
)


def check_keys(m: Any) -> None:
    """The width fits the heads, and the key/value heads the query heads (ModelFamily.check_keys)."""
    check_heads(m)
    if m.n_kv_head is not None and m.n_head % m.n_kv_head:
        raise UserError(
            f"model.n_head={m.n_head} is not a multiple of model.n_kv_head={m.n_kv_head}",
            "pick n_kv_head dividing n_head (each key/value head serves n_head / n_kv_head query heads)",
        )


def estimate_of(m: Any, block_size: int, batch: int) -> tuple[int, int]:
    """(parameters, activation bytes) before building (ModelFamily.estimate): the attention's projections (the
    keys' and values' for n_kv_head heads), the SwiGLU's three, the norms; the activations as the GPT's."""
    head = m.n_embd // max(1, m.n_head)
    kv = (m.n_kv_head or m.n_head) * head
    hidden = swiglu_width(m.n_embd, m.ffn_hidden)
    per_layer = 2 * m.n_embd * m.n_embd + 2 * m.n_embd * kv + 3 * m.n_embd * hidden + 2 * m.n_embd
    _, activations = gpt_estimate(m.n_layer, m.n_head, m.n_embd, block_size, batch)
    return m.n_layer * per_layer + m.n_embd, activations


FAMILY = ModelFamily(
    "llama",
    owns=lambda arch: arch == "llama",
    build=_no_images,
    names=lambda: ["llama"],
    build_lm=_build_llama,
    module_types=(Llama,),
    **STACK.family_fields(),
    keys=BUILTIN_KEYS["llama"],
    hf=HFConverter("llama", "Llama", llama_shape, llama_to_ours, Llama, llama_config, ours_to_llama),
    check_keys=check_keys,
    estimate=estimate_of,
    order=300,
)
