"""The built-in GPT-2-style decoder (`model.arch=gpt`, its family at the end), written so that every parallel
layout can cut it; Hugging Face's GPT-2 in and out is hf.py's.

Shaped for tensor and pipeline parallelism:
- attention has separate `wq`, `wk`, `wv` (column-parallel) and `wo` (row-parallel) projections, and counts its
  heads from the tensor it gets (`view(B, T, -1, head_dim)`), so a rank holding n_head / tp heads just works;
- the blocks sit in a ModuleDict keyed "0", "1", ...: a pipeline stage deletes the blocks it does not run and
  every parameter keeps its full-model name (checkpoints of any layout use the same keys);
- `forward` skips a part set to None (`tok_emb`/`pos_emb` on later stages, `ln_f`/`head` on earlier ones), so a
  stage is the same class with some parts removed: it takes token ids or hidden states and returns hidden
  states or logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.models.blocks import BlockStack
from ddpkit.models.family import ModelFamily, images_refused
from ddpkit.models.flops import decoder_flops
from ddpkit.models.gpt import hf
from ddpkit.models.gpt.keys import CARD
from ddpkit.models.init import Step, init_tensors, normal, post_order, zeros
from ddpkit.models.keys import activation_bytes, check_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.head_dim = n_embd // n_head
        self.wq = nn.Linear(n_embd, n_embd)
        self.wk = nn.Linear(n_embd, n_embd)
        self.wv = nn.Linear(n_embd, n_embd)
        self.wo = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1: the heads this rank holds (all of them, or n_head / tp under tensor parallelism)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_drop(self.wo(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """fc, GELU (exact, or GPT-2's tanh approximation: `approximate="tanh"`), proj."""

    def __init__(self, n_embd: int, dropout: float = 0.0, approximate: str = "none"):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, approximate: str = "none"):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout, approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size); a pipeline stage may hold only some of the parts.

    GPT-2 exactly: learned positions, biases, `gelu_approximate="tanh"`, `tie_embeddings=True` (the head's weight
    is the token embedding's)."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        gelu_approximate: str = "none",
        tie_embeddings: bool = False,
    ):
        super().__init__()
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.gelu_approximate, self.tie_embeddings = gelu_approximate, tie_embeddings
        self.tok_emb: nn.Module | None = nn.Embedding(vocab_size, n_embd)
        self.pos_emb: nn.Module | None = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(n_embd, n_head, dropout, gelu_approximate) for i in range(n_layer)}
        )
        self.ln_f: nn.Module | None = nn.LayerNorm(n_embd)
        self.head: nn.Module | None = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        init_tensors(self, init_steps)  # GPT-2's, from torch's global stream (nothing on the meta device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # the first stage (or the whole model): token ids in
            t = x.shape[1]
            pos = torch.arange(t, device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:  # the last stage (or the whole model): logits out
            x = self.head(x)
        return x


def init_steps(model: GPT) -> Iterator[Step]:
    """GPT-2's initialisation after each layer's own (ModelFamily.init_weights): the Linear and Embedding weights
    normal(0, 0.02) and the biases zero, module by module as nn.Module.apply visits them; then the residual
    projections (the attention's output, the MLP's proj) normal(0, 0.02 / sqrt(2 n_layer)). A head tied to the
    token embedding draws its own weight first, which the tie then replaces."""
    for name, m in post_order(model):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            replaced = model.tie_embeddings and name == "head"
            yield (None if replaced else f"{name}.weight"), m.weight, normal(0.02)
            if getattr(m, "bias", None) is not None:
                yield f"{name}.bias", m.bias, zeros
    for name, p in model.named_parameters():
        if name.endswith(("wo.weight", "proj.weight")):
            yield name, p, normal(0.02 / math.sqrt(2 * model.n_layer))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def estimate(n_layer: int, n_head: int, n_embd: int, block_size: int, batch: int) -> tuple[int, int]:
    """(parameters, bytes of the activations one micro-batch keeps for backward: models.keys.activation_bytes) of
    a GPT, before building it; the token embedding and head (the vocabulary's) left out."""
    params = n_layer * (12 * n_embd * n_embd + 13 * n_embd) + block_size * n_embd + 2 * n_embd
    return params, activation_bytes(n_layer, n_head, n_embd, block_size, batch)


def estimate_of(m: Any, block_size: int, batch: int) -> tuple[int, int]:
    """estimate() from the `model` config section (ModelFamily.estimate)."""
    return estimate(m.n_layer, m.n_head, m.n_embd, block_size, batch)


def _build_gpt(arch: str, vocab_size: int, block_size: int, m: Any) -> nn.Module:
    return GPT(
        vocab_size,
        block_size,
        m.n_layer,
        m.n_head,
        m.n_embd,
        m.dropout,
        gelu_approximate=m.gelu_approximate,
        tie_embeddings=m.tie_embeddings,
    )


# its parallel facts: Megatron-style tensor parallelism (q, k, v and the MLP's fc column-parallel, the attention's
# output and the MLP's proj row-parallel), pipeline stages cut at its blocks, each block re-computed
STACK = BlockStack(
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.fc"),
    row=("attn.wo", "mlp.proj"),
    first=("tok_emb", "pos_emb"),
)

FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=images_refused,
    names=lambda: [CARD.name],
    build_lm=_build_gpt,
    module_types=(GPT,),
    **STACK.family_fields(),
    hf=hf.CONVERTER,
    check_keys=check_heads,
    estimate=estimate_of,
    init_weights=init_steps,
    # the learned position embedding costs no multiply (the PaLM estimate leaves it out)
    flops_per_token=functools.partial(decoder_flops, free=("pos_emb.",)),
    order=200,
)
