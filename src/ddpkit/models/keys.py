"""What the built-in decoder families (gpt/, llama/, and a family of your own shaped like them) share without torch:
their size keys, the check that the width fits the heads, and the activations one micro-batch keeps. Each family's
own keys sit in its folder's keys.py; the families name the key sets they own (`FamilyCard.keys`), and a key set
two families own is documented under both names (config/declared.py). A family of your own declares its keys the
same way: a dataclass of `opt()` fields in `ModelFamily.keys`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpkit.config.schema import opt
from ddpkit.errors import UserError


@dataclass
class TransformerKeys:
    """the decoder's size, dropout, weight tying and Hugging Face starting point."""

    n_layer: int = opt(4, "transformer blocks", gt=0, le=1024)
    n_head: int = opt(4, "attention (query) heads per block (n_embd must be a multiple)", gt=0, le=1024)
    n_embd: int = opt(128, "embedding width", gt=0, le=65536)
    dropout: float = opt(0.0, "dropout probability (0: deterministic, equal on every layout)", ge=0, lt=1)
    tie_embeddings: bool = opt(
        False, "the head shares the token embedding's weight (GPT-2's); not with dist.tp or dist.pp"
    )
    init_from: str | None = opt(
        None,
        "start from a Hugging Face folder (config.json + model.safetensors, or a sharded index) of an "
        "architecture a family reads; every model shape key left unset (model.arch, sizes, heads, norm eps, "
        "rope theta, tied head, data.vocab_size) is its config.json's, and one set otherwise is refused",
    )


def check_heads(m: Any) -> None:
    """The width fits the heads (ModelFamily.check_keys)."""
    if m.n_embd % m.n_head:
        raise UserError(
            f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}",
            "pick n_embd = n_head x the width of one head",
        )


def activation_bytes(n_layer: int, n_head: int, n_embd: int, block_size: int, batch: int) -> int:
    """The bytes of activations one micro-batch of a decoder keeps for backward: per block batch x block x
    n_embd x (34 + 5 x n_head x block / n_embd) half-precision bytes (Korthikanti et al., 2022), doubled for
    float32."""
    per_block = batch * block_size * n_embd * (34 + 5 * n_head * block_size / n_embd)
    return int(2 * n_layer * per_block)
