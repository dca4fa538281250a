"""Hugging Face's Mixtral (MixtralForCausalLM) in and out of the Mixtral-shaped Llama, declared as the Llama's
(models/llama/hf.py, whose keys, fixed values and attention tensors it shares): the experts' count and top-k are
config keys, the router is `block_sparse_moe.gate` and each routed expert's w1, w3, w2 (gate, up, down) is a
tensor of its own in the folder, stacked into the model's (experts, ...) tensors (`HFTensor.stacked`), as
transformers writes them. A model Mixtral cannot hold (dense blocks between the MoE ones, shared experts, sigmoid
scores, weights not renormalized, DeepSeek-V3's bias) is refused before anything is written."""

from __future__ import annotations

from typing import Any

from ddpkit.errors import UserError
from ddpkit.models.family import HFConverter, HFFixed, HFKey, HFTensor
from ddpkit.models.llama.hf import FIXED, KEYS, LLAMA_PARTS, llama_extra

ATTENTION = {ours: theirs for ours, theirs in LLAMA_PARTS.items() if not ours.startswith("mlp.")}
EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's names of a SwiGLU expert's matrices

MIXTRAL_KEYS = (
    *KEYS,  # intermediate_size is the experts' width: model.ffn_hidden, every block's MLP being experts
    HFKey("model.n_experts", ("num_local_experts", "num_experts")),
    HFKey("model.experts_per_token", "num_experts_per_tok", default=2),
)
MIXTRAL_FIXED = (
    *FIXED,
    HFFixed("sliding_window", (), "a sliding window of attention"),
    HFFixed("router_jitter_noise", (0, 0.0), "jitter noise on the router's input"),
)


def refuse_unheld(m: Any, label: str, **held: Any) -> None:
    """A UserError naming the first of `m`'s expert keys (cfg.model or the model) whose value is not the one
    `held` says the folder's architecture can hold."""
    for key, value in held.items():
        if getattr(m, key, value) != value:
            raise UserError(
                f"a {label} folder cannot hold model.{key}={getattr(m, key)} (it holds {value})",
                f"export a model trained with model.{key}={str(value).lower()}",
            )


def expert_tensors(i: int, prefix: str, n_experts: int, names: dict[str, str]) -> dict[str, HFTensor]:
    """Block `i`'s router and routed experts (`names`: ours -> the folder's name of an expert's matrix) under the
    folder's `prefix` of the block's MoE (e.g. "model.layers.0.block_sparse_moe")."""
    out = {f"blocks.{i}.mlp.router.weight": HFTensor(f"{prefix}.gate.weight")}
    for ours, theirs in names.items():
        out[f"blocks.{i}.mlp.experts.{ours}"] = HFTensor(
            f"{prefix}.experts.{{}}.{theirs}.weight", stacked=n_experts
        )
    return out


def mixtral_tensors(m: Any) -> dict[str, HFTensor]:
    """The Mixtral's tensors in the folder (`m`: the model's keys, cfg.model or the model itself)."""
    refuse_unheld(
        m,
        "Mixtral",
        moe_every=1,
        n_shared_experts=0,
        moe_score="softmax",
        moe_norm_topk=True,
        moe_balance="aux",
    )
    out = {
        "tok_emb.weight": HFTensor("model.embed_tokens.weight"),
        "ln_f.weight": HFTensor("model.norm.weight"),
    }
    for i in range(m.n_layer):
        for ours, theirs in ATTENTION.items():
            out[f"blocks.{i}.{ours}.weight"] = HFTensor(f"model.layers.{i}.{theirs}.weight")
        out.update(expert_tensors(i, f"model.layers.{i}.block_sparse_moe", m.n_experts, EXPERTS))
    out["head.weight"] = HFTensor("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")
    return out


def mixtral_extra(m: Any) -> dict[str, Any]:
    extra = {**llama_extra(m), "architectures": ["MixtralForCausalLM"], "sliding_window": None}
    del extra["attention_bias"], extra["mlp_bias"]  # not Mixtral's keys
    return {**extra, "router_jitter_noise": 0.0, "output_router_logits": False}


CONVERTER = HFConverter(
    "mixtral",
    "Mixtral",
    keys=MIXTRAL_KEYS,
    fixed=MIXTRAL_FIXED,
    tensors=mixtral_tensors,
    ignored=lambda m: (r"\.rotary_emb\.inv_freq$", *((r"^lm_head\.weight$",) if m.tie_embeddings else ())),
    extra=mixtral_extra,
)
