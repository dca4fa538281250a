"""The built-in Llama-style decoder (`model.arch=llama`, its family at the end): rotary position embeddings (RoPE,
base model.rope_theta), RMSNorm, a SwiGLU MLP and grouped-query attention (model.n_kv_head key/value heads shared
by groups of the model.n_head query heads), no biases; the head tied to the token embedding when
model.tie_embeddings. It holds the Llama architecture of Hugging Face transformers exactly (hf.py maps the
names; its `HFConverter` is part of the family at the end).

Shaped like the GPT (models/gpt/model.py) for the parallel layouts: separate `wq`, `wk`, `wv`, `wo` and `gate`, `up`,
`down` projections (column- and row-parallel), heads counted from the tensor a rank gets, blocks in a ModuleDict
keyed "0", "1", ..., and `forward` skipping a part set to None.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.errors import UserError
from ddpkit.models.blocks import BlockStack
from ddpkit.models.family import ModelFamily, images_refused
from ddpkit.models.keys import activation_bytes, check_heads
from ddpkit.models.llama import hf
from ddpkit.models.llama.keys import CARD


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
    keys' and values' for n_kv_head heads), the SwiGLU's three, the norms; the activations as every decoder's (models.keys.activation_bytes)."""
    head = m.n_embd // max(1, m.n_head)
    kv = (m.n_kv_head or m.n_head) * head
    hidden = swiglu_width(m.n_embd, m.ffn_hidden)
    per_layer = 2 * m.n_embd * m.n_embd + 2 * m.n_embd * kv + 3 * m.n_embd * hidden + 2 * m.n_embd
    activations = activation_bytes(m.n_layer, m.n_head, m.n_embd, block_size, batch)
    return m.n_layer * per_layer + m.n_embd, activations


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=images_refused,
    names=lambda: [CARD.name],
    build_lm=_build_llama,
    module_types=(Llama,),
    **STACK.family_fields(),
    hf=hf.CONVERTER,
    check_keys=check_keys,
    estimate=estimate_of,
    order=300,
)
