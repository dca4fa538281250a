"""The built-in GPT-2-style decoder (`model.arch=gpt`, its family at the end), written so that every parallel
layout can cut it.

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

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpkit.errors import UserError
from ddpkit.models.blocks import BlockStack
from ddpkit.models.family import HFConverter, ModelFamily
from ddpkit.models.hf import need, refuse
from ddpkit.models.keys import BUILTIN_KEYS


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
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("wo.weight", "proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def estimate(n_layer: int, n_head: int, n_embd: int, block_size: int, batch: int) -> tuple[int, int]:
    """(parameters, bytes of the activations one micro-batch keeps for backward) of a GPT, before building it;
    the token embedding and head (the vocabulary's) left out. Activations: per block
    batch x block x n_embd x (34 + 5 x n_head x block / n_embd) half-precision bytes (Korthikanti et al., 2022),
    doubled for float32."""
    params = n_layer * (12 * n_embd * n_embd + 13 * n_embd) + block_size * n_embd + 2 * n_embd
    per_block = batch * block_size * n_embd * (34 + 5 * n_head * block_size / n_embd)
    return params, int(2 * n_layer * per_block)


def estimate_of(m: Any, block_size: int, batch: int) -> tuple[int, int]:
    """estimate() from the `model` config section (ModelFamily.estimate)."""
    return estimate(m.n_layer, m.n_head, m.n_embd, block_size, batch)


def check_heads(m: Any) -> None:
    """The width fits the heads (ModelFamily.check_keys)."""
    if m.n_embd % m.n_head:
        raise UserError(
            f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}",
            "pick n_embd = n_head x the width of one head",
        )


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


def _no_images(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    raise UserError(
        f"model.arch={arch} is a language model: it reads text, not images", "use data.dataset=text or tokens"
    )


# Hugging Face's GPT-2 (GPT2LMHeadModel) in and out (models/hf.py reads and writes the folder). Its names and
# shapes against the GPT's: `transformer.wte` = `tok_emb`, `wpe` = `pos_emb`, `h.N.ln_1/ln_2` = `blocks.N.ln1/ln2`,
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


def gpt_to_gpt2(model: GPT) -> dict[str, torch.Tensor]:
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


def gpt2_config(m: GPT) -> dict[str, Any]:
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


# its parallel facts: Megatron-style tensor parallelism (q, k, v and the MLP's fc column-parallel, the attention's
# output and the MLP's proj row-parallel), pipeline stages cut at its blocks, each block re-computed
STACK = BlockStack(
    column=("attn.wq", "attn.wk", "attn.wv", "mlp.fc"),
    row=("attn.wo", "mlp.proj"),
    first=("tok_emb", "pos_emb"),
)

FAMILY = ModelFamily(
    "gpt",
    owns=lambda arch: arch == "gpt",
    build=_no_images,
    names=lambda: ["gpt"],
    build_lm=_build_gpt,
    module_types=(GPT,),
    **STACK.family_fields(),
    keys=BUILTIN_KEYS["gpt"],
    hf=HFConverter("gpt2", "GPT-2", gpt2_shape, gpt2_to_gpt, GPT, gpt2_config, gpt_to_gpt2),
    check_keys=check_heads,
    estimate=estimate_of,
    order=200,
)
