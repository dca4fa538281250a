"""Hugging Face's GPT-2 (GPT2LMHeadModel) in and out of the GPT, declared (models/hf/ reads and writes the folder
and asks the family's `HFConverter`, made of these): which config.json values are which config keys, the values
the GPT holds one way only, and where each of its tensors lies in the folder."""

from __future__ import annotations

from typing import Any

from ddpkit.models.family import HFConverter, HFFixed, HFKey, HFTensor

# GPT2LMHeadModel's names and shapes against the GPT's: `transformer.wte` = `tok_emb`, `wpe` = `pos_emb`, `h.N.ln_1/ln_2` = `blocks.N.ln1/ln2`,
# `h.N.attn.c_attn` (a Conv1D: weight (in, 3 x out), q|k|v side by side) = `wq`, `wk`, `wv` (Linear: weight
# (out, in)), `attn.c_proj` = `wo`, `mlp.c_fc` = `mlp.fc`, `mlp.c_proj` = `mlp.proj`, `ln_f` = `ln_f`, `lm_head` =
# `head` (tied to `wte` unless tie_word_embeddings is false).
KEYS = (
    HFKey("data.vocab_size", "vocab_size"),
    HFKey("data.block_size", "n_positions"),  # the learned positions' rows: a shape of the model
    HFKey("model.n_layer", "n_layer"),
    HFKey("model.n_head", "n_head"),
    HFKey("model.n_embd", "n_embd"),
    HFKey(
        "model.gelu_approximate",
        "activation_function",
        default="gelu_new",
        values=(("gelu_new", "tanh"), ("gelu", "none"), ("gelu_pytorch_tanh", "tanh")),
    ),
    HFKey("model.tie_embeddings", "tie_word_embeddings", default=True),
)
FIXED = (
    HFFixed("layer_norm_epsilon", (1e-5,), "another layer_norm_epsilon than 1e-5"),
    HFFixed("scale_attn_weights", (True,), "unscaled attention"),
    HFFixed("scale_attn_by_inverse_layer_idx", (False,), "attention scaled by the layer's index"),
    HFFixed("reorder_and_upcast_attn", (False,), "reordered attention"),
    HFFixed("add_cross_attention", (False,), "cross-attention"),
)


def gpt2_check(raw: dict[str, Any], cfg: Any) -> str | None:
    """What else config.json asks: an MLP width (n_inner) other than 4 x n_embd."""
    inner, n_embd = raw.get("n_inner"), cfg.model.n_embd
    if inner is not None and (isinstance(inner, bool) or inner != 4 * n_embd):
        return (
            f"n_inner={inner!r} (not 4 x n_embd = {4 * n_embd}) asks for an MLP width the GPT does not hold"
        )
    return None


def _pairs(n_layer: int):
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


def gpt2_tensors(m: Any) -> dict[str, HFTensor]:
    """The GPT's tensors in the folder (`m`: the model's keys, cfg.model or the model itself)."""
    out = {ours: HFTensor(theirs, flip) for ours, theirs, flip in _pairs(m.n_layer)}
    for i in range(m.n_layer):
        h, b = f"transformer.h.{i}.attn.c_attn.", f"blocks.{i}.attn."
        for k, name in enumerate(("wq", "wk", "wv")):  # q|k|v side by side in one Conv1D
            out[f"{b}{name}.weight"] = HFTensor(h + "weight", True, k, 3)
            out[f"{b}{name}.bias"] = HFTensor(h + "bias", False, k, 3)
    out["head.weight"] = HFTensor("transformer.wte.weight" if m.tie_embeddings else "lm_head.weight")
    return out


def gpt2_extra(m: Any) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


CONVERTER = HFConverter(
    "gpt2",
    "GPT-2",
    keys=KEYS,
    fixed=FIXED,
    check=gpt2_check,
    tensors=gpt2_tensors,
    # older folders keep the attention's causal-mask buffers; transformers ties the head and ignores lm_head
    ignored=lambda m: (r"\.attn\.(masked_)?bias$", *((r"^lm_head\.weight$",) if m.tie_embeddings else ())),
    # a GPT2Model's folder (no head) names its tensors without the `transformer.` prefix
    rename=lambda name: name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name,
    extra=gpt2_extra,
)
