"""Hugging Face's Qwen3-MoE (Qwen3MoeForCausalLM) in and out of the Qwen3-MoE-shaped Llama, declared as the
Mixtral's (models/mixtral/hf.py): the Llama's keys and attention tensors, the norms of the query and key heads
(`self_attn.q_norm`, `k_norm`), the router as `mlp.gate` and each routed expert's gate_proj, up_proj, down_proj a
tensor of its own, stacked into the model's (experts, ...) tensors; `decoder_sparse_step` is model.moe_every (the
blocks between are the dense SwiGLU of `intermediate_size`), `moe_intermediate_size` the experts' width,
`norm_topk_prob` whether the chosen experts' weights are renormalized. A model Qwen3-MoE cannot hold (shared
experts, sigmoid scores, DeepSeek-V3's bias) is refused before anything is written."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFKey, HFTensor
from ddpkit.models.keys import moe_blocks
from ddpkit.models.llama.hf import FIXED, KEYS, LLAMA_PARTS, llama_extra, llama_ignored
from ddpkit.models.mixtral.hf import ATTENTION, expert_tensors, refuse_unheld

EXPERTS = {
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}  # an expert's matrices, as the Llama's MLP
DENSE = {ours: theirs for ours, theirs in LLAMA_PARTS.items() if ours.startswith("mlp.")}
HEAD_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}

QWEN3_MOE_KEYS = (
    *KEYS,  # intermediate_size is the dense blocks' SwiGLU width; no head_dim: hidden_size / heads, as its reader
    HFKey("model.n_experts", ("num_local_experts", "num_experts")),
    HFKey("model.experts_per_token", "num_experts_per_tok", default=8),
    HFKey("model.moe_ffn_hidden", "moe_intermediate_size"),
    HFKey("model.moe_every", "decoder_sparse_step", default=1),
    HFKey("model.moe_norm_topk", "norm_topk_prob", default=False),
)
QWEN3_MOE_FIXED = (
    *FIXED,
    HFFixed("mlp_only_layers", ([],), "dense blocks other than every decoder_sparse_step-th"),
    HFFixed("use_sliding_window", (False,), "a sliding window of attention"),
)


def qwen3_moe_tensors(m: Any) -> dict[str, HFTensor]:
    """The Qwen3-MoE's tensors in the folder (`m`: the model's keys, cfg.model or the model itself)."""
    refuse_unheld(m, "Qwen3-MoE", n_shared_experts=0, moe_score="softmax", moe_balance="aux")
    out = {
        "tok_emb.weight": HFTensor("model.embed_tokens.weight"),
        "ln_f.weight": HFTensor("model.norm.weight"),
    }
    sparse = set(moe_blocks(m.n_layer, m.moe_every))
    for i in range(m.n_layer):
        for ours, theirs in {**ATTENTION, **HEAD_NORMS}.items():
            out[f"blocks.{i}.{ours}.weight"] = HFTensor(f"model.layers.{i}.{theirs}.weight")
        if i in sparse:
            out.update(expert_tensors(i, f"model.layers.{i}.mlp", m.n_experts, EXPERTS))
        else:
            for ours, theirs in DENSE.items():
                out[f"blocks.{i}.{ours}.weight"] = HFTensor(f"model.layers.{i}.{theirs}.weight")
    out["head.weight"] = HFTensor("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")
    return out


def qwen3_moe_extra(m: Any) -> dict[str, Any]:
    extra = {**llama_extra(m), "architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": []}
    del extra["mlp_bias"]  # not Qwen3-MoE's key
    return {**extra, "use_sliding_window": False, "sliding_window": None, "output_router_logits": False}


CONVERTER = HFConverter(
    "qwen3_moe",
    "Qwen3-MoE",
    keys=QWEN3_MOE_KEYS,
    fixed=QWEN3_MOE_FIXED,
    tensors=qwen3_moe_tensors,
    ignored=llama_ignored,
    extra=qwen3_moe_extra,
)
