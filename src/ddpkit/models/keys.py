"""The config keys the built-in transformer families own (model.arch=gpt and llama): their size and shape, declared
into the `model` section (config/declared.py) and named by each family's `keys`. They sit apart from the models,
which import torch, so that a config loads without torch (ddpkit.models declares them when it is imported).
A family of your own declares its keys the same way: a dataclass of `opt()` fields in `ModelFamily.keys`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpkit.config.schema import opt


@dataclass
class TransformerKeys:
    """the decoder's size, dropout, weight tying and Hugging Face starting point."""

    n_layer: int = opt(4, "gpt, llama: transformer blocks", gt=0, le=1024)
    n_head: int = opt(
        4, "gpt, llama: attention (query) heads per block (n_embd must be a multiple)", gt=0, le=1024
    )
    n_embd: int = opt(128, "gpt, llama: embedding width", gt=0, le=65536)
    dropout: float = opt(
        0.0, "gpt, llama: dropout probability (0: deterministic, equal on every layout)", ge=0, lt=1
    )
    tie_embeddings: bool = opt(
        False,
        "gpt, llama: the head shares the token embedding's weight (GPT-2's); not with dist.tp or dist.pp",
    )
    init_from: str | None = opt(
        None,
        "gpt, llama: start from a Hugging Face folder (config.json + model.safetensors, or a sharded index) of "
        "the GPT-2 (model.arch=gpt) or Llama (llama) architecture; its shape must be this config's",
    )


@dataclass
class GPTKeys:
    """the GPT-2-style decoder's MLP."""

    gelu_approximate: Literal["none", "tanh"] = opt(
        "none", "gpt: the MLP's GELU, exact (none) or the tanh approximation GPT-2 uses"
    )


@dataclass
class LlamaKeys:
    """the Llama-style decoder's grouped-query attention, SwiGLU width, rotary embeddings and RMSNorm."""

    n_kv_head: int | None = opt(
        None, "llama: key/value heads, each serving n_head / n_kv_head query heads; null: n_head", gt=0
    )
    ffn_hidden: int | None = opt(
        None, "llama: the SwiGLU MLP's width; null: 8 x n_embd / 3 rounded up to a multiple of 8", gt=0
    )
    rope_theta: float = opt(10000.0, "llama: the base of the rotary position embeddings", gt=0)
    norm_eps: float = opt(1e-5, "llama: the RMSNorm epsilon", gt=0, lt=1)


# model.arch -> the key sets its family owns (gpt.FAMILY.keys, llama.FAMILY.keys)
BUILTIN_KEYS: dict[str, tuple[type, ...]] = {
    "gpt": (TransformerKeys, GPTKeys),
    "llama": (TransformerKeys, LlamaKeys),
}
