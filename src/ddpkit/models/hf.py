"""Hugging Face weights in and out, with safetensors (no pickle): a folder of `config.json` and `model.safetensors`
(or `model.safetensors.index.json` and its shards) of the GPT-2 or the Llama architecture, mapped onto the
built-in `gpt` and `llama` families and back. transformers itself is never imported here: the folder's format is
plain JSON and safetensors.

Llama's names (LlamaForCausalLM) are the Llama's (models/llama.py) one for one: `model.embed_tokens` = `tok_emb`,
`model.layers.N.input_layernorm/post_attention_layernorm` = `blocks.N.ln1/ln2`, `self_attn.q/k/v/o_proj` =
`attn.wq/wk/wv/wo`, `mlp.gate/up/down_proj` = `mlp.gate/up/down`, `model.norm` = `ln_f`, `lm_head` = `head`.

GPT-2's names and shapes (GPT2LMHeadModel) against the GPT's (ddpkit/models/gpt.py):
`transformer.wte` = `tok_emb`, `wpe` = `pos_emb`, `h.N.ln_1/ln_2` = `blocks.N.ln1/ln2`, `h.N.attn.c_attn` (a Conv1D:
weight (in, 3 x out), q|k|v side by side) = `wq`, `wk`, `wv` (Linear: weight (out, in)), `attn.c_proj` = `wo`,
`mlp.c_fc` = `mlp.fc`, `mlp.c_proj` = `mlp.proj`, `ln_f` = `ln_f`, `lm_head` = `head` (tied to `wte` unless
tie_word_embeddings is false).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import UserError, first_line

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": None, "gelu": "none"}
HINT = (
    "give a folder saved by transformers' save_pretrained of a GPT2LMHeadModel or LlamaForCausalLM "
    "(config.json + model.safetensors)"
)
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


def is_hf_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_config(folder: Path) -> dict[str, Any]:
    from ddpkit.config.bounded import loads_json

    path = folder / CONFIG
    try:
        raw = path.read_bytes()[: MAX_CONFIG_BYTES + 1]
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes")
        cfg = loads_json(raw.decode("utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read '{path}': {first_line(e, limit=150, joined=True)}", HINT) from None
    if not isinstance(cfg, dict):
        raise UserError(f"'{path}' is not a JSON object", HINT)
    return cfg


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif (folder / INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"cannot read '{folder / INDEX}': {first_line(e, joined=True)}", HINT) from None
        files = [folder / n for n in names]
        outside = [n for n in names if Path(n).name != n]
        if outside:
            raise UserError(f"'{folder / INDEX}' names a file outside the folder: {outside[0]}", HINT)
    else:
        raise UserError(f"'{folder}' holds no {WEIGHTS} or {INDEX}", HINT)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f, device="cpu"))
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read '{f}': {first_line(e, joined=True)}", HINT) from None
    return tensors


def _need(cfg: dict, key: str, folder: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"'{folder / CONFIG}' has no positive integer '{key}'", HINT)
    return value


def _refuse(unsupported: list[tuple[Any, str]], folder: Path, family: str) -> None:
    for bad, what in unsupported:
        if bad:
            raise UserError(
                f"'{folder / CONFIG}' asks for {what}, which the built-in {family} does not hold", HINT
            )


def llama_shape(cfg: dict, folder: Path) -> dict[str, Any]:
    """The Llama's constructor arguments for a Llama config.json; UserError for what it cannot hold."""
    n_embd, n_head = _need(cfg, "hidden_size", folder), _need(cfg, "num_attention_heads", folder)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    _refuse(
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
        "vocab_size": _need(cfg, "vocab_size", folder),
        "block_size": _need(cfg, "max_position_embeddings", folder),
        "n_layer": _need(cfg, "num_hidden_layers", folder),
        "n_head": n_head,
        "n_embd": n_embd,
        "n_kv_head": cfg.get("num_key_value_heads") or n_head,
        "ffn_hidden": _need(cfg, "intermediate_size", folder),
        "rope_theta": float(theta),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def llama_to_ours(hf: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    out = {"tok_emb.weight": hf["model.embed_tokens.weight"], "ln_f.weight": hf["model.norm.weight"]}
    for i in range(n_layer):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"blocks.{i}.{ours}.weight"] = hf[f"model.layers.{i}.{theirs}.weight"]
    out["head.weight"] = out["tok_emb.weight"] if tied else hf["lm_head.weight"]
    return out


def ours_to_llama(sd: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["ln_f.weight"]}
    for i in range(n_layer):
        for ours, theirs in LLAMA_PARTS.items():
            out[f"model.layers.{i}.{theirs}.weight"] = sd[f"blocks.{i}.{ours}.weight"]
    if not tied:
        out["lm_head.weight"] = sd["head.weight"]
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def gpt2_shape(cfg: dict, folder: Path) -> dict[str, Any]:
    """The GPT's constructor arguments for a GPT-2 config.json; UserError for what the GPT cannot hold."""
    n_embd = _need(cfg, "n_embd", folder)
    act = GELU.get(cfg.get("activation_function", "gelu_new"))
    unsupported = [
        (act is None, f"activation_function={cfg.get('activation_function')}"),
        (cfg.get("n_inner") not in (None, 4 * n_embd), f"n_inner={cfg.get('n_inner')} (not 4 x n_embd)"),
        (cfg.get("layer_norm_epsilon", 1e-5) != 1e-5, f"layer_norm_epsilon={cfg.get('layer_norm_epsilon')}"),
        (cfg.get("scale_attn_weights", True) is not True, "scale_attn_weights=false"),
        (cfg.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=true"),
    ]
    for bad, what in unsupported:
        if bad:
            raise UserError(
                f"'{folder / CONFIG}' asks for {what}, which the built-in GPT does not hold", HINT
            )
    return {
        "vocab_size": _need(cfg, "vocab_size", folder),
        "block_size": _need(cfg, "n_positions", folder),
        "n_layer": _need(cfg, "n_layer", folder),
        "n_head": _need(cfg, "n_head", folder),
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


def gpt2_to_gpt(hf: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel's (or GPT2Model's) tensors under the GPT's names."""
    hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf.items()}
    out = {ours: hf[theirs].t() if flip else hf[theirs] for ours, theirs, flip in _gpt2_pairs(n_layer)}
    for i in range(n_layer):
        h, b = f"transformer.h.{i}.attn.c_attn.", f"blocks.{i}.attn."
        w, bias = hf[h + "weight"].t(), hf[h + "bias"]  # q|k|v side by side
        for name, wp, bp in zip(("wq", "wk", "wv"), w.chunk(3, 0), bias.chunk(3, 0), strict=True):
            out[f"{b}{name}.weight"], out[f"{b}{name}.bias"] = wp, bp
    out["head.weight"] = out["tok_emb.weight"] if tied else hf["lm_head.weight"]
    return out


def gpt_to_gpt2(sd: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    """The GPT's state dict under GPT2LMHeadModel's names (the inverse of gpt2_to_gpt)."""
    out = {theirs: sd[ours].t() if flip else sd[ours] for ours, theirs, flip in _gpt2_pairs(n_layer)}
    for i in range(n_layer):
        h, b = f"transformer.h.{i}.attn.c_attn.", f"blocks.{i}.attn."
        out[h + "weight"] = torch.cat([sd[f"{b}{n}.weight"] for n in ("wq", "wk", "wv")], 0).t()
        out[h + "bias"] = torch.cat([sd[f"{b}{n}.bias"] for n in ("wq", "wk", "wv")], 0)
    if not tied:
        out["lm_head.weight"] = sd["head.weight"]
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


# model_type -> (model.arch, its shape from config.json, its tensors under our names)
ARCHS = {"gpt2": ("gpt", gpt2_shape, gpt2_to_gpt), "llama": ("llama", llama_shape, llama_to_ours)}


def load_folder(path: str | os.PathLike) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """(model.arch, the family's constructor arguments, its state dict) from a Hugging Face GPT-2 or Llama folder;
    UserError when it is not one."""
    folder = Path(path)
    cfg = read_config(folder)
    kind = cfg.get("model_type")
    if kind not in ARCHS:
        raise UserError(
            f"'{folder}' holds a model of type '{kind}'; ddpkit reads the GPT-2 (gpt2) and Llama (llama) "
            "architectures",
            HINT,
        )
    arch, shape_of, convert = ARCHS[kind]
    shape = shape_of(cfg, folder)
    tensors = read_tensors(folder)
    try:
        sd = convert(tensors, shape["n_layer"], shape["tie_embeddings"])
    except KeyError as e:
        raise UserError(f"'{folder}' has no tensor {e} that its config.json's model holds", HINT) from None
    return arch, shape, {k: v.contiguous() for k, v in sd.items()}


def model_class(arch: str) -> type:
    """The built-in class of model.arch `arch` (gpt or llama)."""
    from ddpkit.models.gpt import GPT
    from ddpkit.models.llama import Llama

    return GPT if arch == "gpt" else Llama


def build(arch: str, shape: dict[str, Any]) -> torch.nn.Module:
    return model_class(arch)(**shape)


def load_into(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str) -> None:
    """`sd` into `model` (strict); UserError naming the first tensor whose shape differs."""
    own = model.state_dict()
    for k, v in sd.items():
        if k in own and own[k].shape != v.shape:
            raise UserError(
                f"{where}: tensor {k} is {tuple(v.shape)} but this model's is {tuple(own[k].shape)}",
                "set model.n_layer, n_head, n_embd, data.block_size and the vocabulary to the folder's",
            )
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise UserError(f"{where} does not fit this model: {first_line(e, joined=True)}", HINT) from None


def llama_config(m: Any) -> dict[str, Any]:
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
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def export(model: torch.nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write `model` (a built-in GPT or Llama) as a Hugging Face folder: config.json and model.safetensors."""
    from ddpkit.atomicio import atomic_write
    from ddpkit.models.llama import Llama

    m = model
    if isinstance(m, Llama):
        cfg, tensors = llama_config(m), ours_to_llama(m.state_dict(), m.n_layer, m.tie_embeddings)
    else:
        cfg, tensors = gpt2_config(m), gpt_to_gpt2(m.state_dict(), m.n_layer, m.tie_embeddings)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda fh: fh.write(_safetensors_bytes(tensors)))
    atomic_write(out / CONFIG, lambda fh: fh.write(json.dumps(cfg, indent=2).encode("utf-8")))
    return out


def gpt2_config(m: Any) -> dict[str, Any]:
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
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})
