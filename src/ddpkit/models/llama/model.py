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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.errors import UserError
from ddpkit.models.blocks import BlockStack
from ddpkit.models.family import FamilyCard, HFConverter, ModelFamily, images_refused
from ddpkit.models.init import Step, init_tensors, normal, zeros
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


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """The (t, t) boolean mask of causal attention over a sliding window: position q sees position k when
    q - window < k <= q (its own and the window - 1 before it), as transformers' sliding-window mask."""
    i = torch.arange(t, device=device)
    back = i[:, None] - i[None, :]
    return (back >= 0) & (back < window)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; the options of the Llama-shaped families: `head_dim` other than
    n_embd / n_head, biases on q, k and v (`qkv_bias`, Qwen2's), an RMSNorm of each query and key head before the
    rotation (`qk_norm_eps`, Qwen3's: None for none) and a sliding window of `window` positions (Mistral's)."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        n_kv_head: int,
        theta: float,
        dropout: float = 0.0,
        *,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        window: int | None = None,
    ):
        super().__init__()
        if (head_dim is None and n_embd % n_head) or n_head % n_kv_head:
            raise ValueError(
                f"n_embd ({n_embd}) % n_head ({n_head}) and n_head % n_kv_head ({n_kv_head}) must be 0"
            )
        self.head_dim, self.group, self.theta = head_dim or n_embd // n_head, n_head // n_kv_head, theta
        self.wq = nn.Linear(n_embd, n_head * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_head * self.head_dim, n_embd, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # over each head's width, shared by the heads
            self.q_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)
        self.dropout, self.window = dropout, window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1: the heads this rank holds (all, or n_head / tp and n_kv_head / tp under tensor parallelism)
        q, k, v = (w(x).view(b, t, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope(t, self.head_dim, self.theta, x.device)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        if self.group > 1:  # grouped-query attention: each key/value head serves `group` query heads
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        drop = self.dropout if self.training else 0.0
        if self.window is not None and self.window < t:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=window_mask(t, self.window, x.device), dropout_p=drop
            )
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
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
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)): the MLP a SwiGLU of width `hidden` unless one is given (a
    family of mixture-of-experts blocks gives its own); `attention`: the Attention's options."""

    def __init__(
        self,
        n_embd,
        n_head,
        n_kv_head,
        hidden,
        theta,
        eps,
        dropout=0.0,
        mlp: nn.Module | None = None,
        **attention,
    ):
        super().__init__()
        self.ln1 = nn.RMSNorm(n_embd, eps=eps)
        self.attn = Attention(n_embd, n_head, n_kv_head, theta, dropout, **attention)
        self.ln2 = nn.RMSNorm(n_embd, eps=eps)
        self.mlp = mlp if mlp is not None else SwiGLU(n_embd, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size); a pipeline stage may hold only some of the parts.

    The Llama-shaped families (models/qwen2/, qwen3/, mistral/) are this model with their attention's options
    fixed by a subclass of their own: `head_dim` (default n_embd / n_head), `qkv_bias` (Qwen2), `qk_norm`
    (Qwen3: an RMSNorm of each query and key head) and `sliding_window` (Mistral: each position attends to the
    last `sliding_window` positions, itself included; None: all before it)."""

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
        *,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.vocab_size, self.block_size, self.dropout = vocab_size, block_size, dropout
        self.n_layer, self.n_head, self.n_embd, self.n_kv_head = n_layer, n_head, n_embd, n_kv_head or n_head
        self.ffn_hidden = swiglu_width(n_embd, ffn_hidden)
        self.rope_theta, self.norm_eps, self.tie_embeddings = rope_theta, norm_eps, tie_embeddings
        self.head_dim, self.qkv_bias, self.qk_norm = head_dim or n_embd // n_head, qkv_bias, qk_norm
        self.sliding_window = sliding_window
        self.tok_emb: nn.Module | None = nn.Embedding(vocab_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict({str(i): self.block(i) for i in range(n_layer)})
        self.ln_f: nn.Module | None = nn.RMSNorm(n_embd, eps=norm_eps)
        self.head: nn.Module | None = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        init_tensors(self, init_steps)  # from torch's global stream (nothing on the meta device)

    def block(self, i: int, mlp: nn.Module | None = None) -> nn.Module:
        """Block `i` of the stack, its MLP `mlp` or a SwiGLU (a family whose blocks differ, experts say, gives its
        own)."""
        return Block(
            self.n_embd, self.n_head, self.n_kv_head, self.ffn_hidden, self.rope_theta, self.norm_eps,
            self.dropout, mlp, head_dim=self.head_dim, qkv_bias=self.qkv_bias,
            qk_norm_eps=self.norm_eps if self.qk_norm else None, window=self.sliding_window,
        )  # fmt: skip

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


def init_steps(model: Llama) -> Iterator[Step]:
    """Its initialisation after each layer's own (ModelFamily.init_weights), as the GPT's: every matrix normal(0,
    0.02), the residual projections (the attention's output, the SwiGLU's down) normal(0, 0.02 / sqrt(2
    n_layer)), the biases (Qwen2's q, k and v) zero, in the order of named_parameters; a head tied to the token
    embedding draws its own weight first, which the tie then replaces."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * model.n_layer) if name.endswith(("wo.weight", "down.weight")) else 0.02
            replaced = model.tie_embeddings and name == "head.weight"
            yield (None if replaced else name), p, normal(std)
        elif name.endswith(".bias"):
            yield name, p, zeros


def builder(model: type[Llama], windowed: bool = False) -> Callable[[str, int, int, Any], nn.Module]:
    """ModelFamily.build_lm of a Llama-shaped family: `model` (Llama or a subclass fixing its options) of the
    config's keys, model.sliding_window among them when `windowed` (the family owns the key)."""

    def build(arch: str, vocab_size: int, block_size: int, m: Any) -> nn.Module:
        window = {"sliding_window": m.sliding_window} if windowed else {}
        return model(
            vocab_size, block_size, m.n_layer, m.n_head, m.n_embd, n_kv_head=m.n_kv_head,
            ffn_hidden=m.ffn_hidden, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings, dropout=m.dropout, head_dim=m.head_dim, **window,
        )  # fmt: skip

    return build


# its parallel facts: as the GPT's, the SwiGLU's gate and up column-parallel and its down row-parallel, the
# key/value heads split over dist.tp too, and the norms of each query and key head (where a family has them)
# replicated over the heads a rank holds
STACK = BlockStack(
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up"),
    row=("attn.wo", "mlp.down"),
    head_norms=("attn.q_norm", "attn.k_norm"),
    tp_keys=("model.n_head", "model.n_embd", "model.n_kv_head"),
)


def check_keys(m: Any) -> None:
    """The width fits the heads (unless model.head_dim gives the heads' width), and the key/value heads the query
    heads (ModelFamily.check_keys)."""
    if m.head_dim is None:
        check_heads(m)
    if m.n_kv_head is not None and m.n_head % m.n_kv_head:
        raise UserError(
            f"model.n_head={m.n_head} is not a multiple of model.n_kv_head={m.n_kv_head}",
            "pick n_kv_head dividing n_head (each key/value head serves n_head / n_kv_head query heads)",
        )


def estimate_of(m: Any, block_size: int, batch: int) -> tuple[int, int]:
    """(parameters, activation bytes) before building (ModelFamily.estimate): the attention's projections (the
    keys' and values' for n_kv_head heads), the SwiGLU's three, the norms; the activations as every decoder's (models.keys.activation_bytes)."""
    head = m.head_dim or m.n_embd // max(1, m.n_head)
    q, kv = m.n_head * head, (m.n_kv_head or m.n_head) * head
    hidden = swiglu_width(m.n_embd, m.ffn_hidden)
    per_layer = 2 * m.n_embd * q + 2 * m.n_embd * kv + 3 * m.n_embd * hidden + 2 * m.n_embd
    activations = activation_bytes(m.n_layer, m.n_head, m.n_embd, block_size, batch)
    return m.n_layer * per_layer + m.n_embd, activations


def llama_shaped(
    card: FamilyCard, model: type[Llama], converter: HFConverter | None, order: int, windowed: bool = False
) -> ModelFamily:
    """The ModelFamily of a Llama-shaped family (the Llama's, Qwen2's, ...): `model` (the Llama or a subclass
    fixing its options) built from the config's keys (model.sliding_window among them when `windowed`), the
    Llama's parallel facts, checks, size estimate and initialisation, and the family's own Hugging Face converter."""
    return ModelFamily(
        **card.fields(),
        owns=card.owns,
        build=images_refused,
        names=lambda: [card.name],
        build_lm=builder(model, windowed),
        module_types=(model,),
        **STACK.family_fields(),
        hf=converter,
        check_keys=check_keys,
        estimate=estimate_of,
        init_weights=init_steps,
        order=order,
    )


FAMILY = llama_shaped(
    CARD,
    Llama,
    hf.CONVERTER,
    order=300,
)
