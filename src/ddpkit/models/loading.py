"""`ddpkit.load_model(path)`: a language model, in eval mode on the CPU, from a ddpkit checkpoint (a `.pt` file, a
sharded `.dcp` folder, or a run directory: its best checkpoint, else its last) or from a Hugging Face GPT-2 or
Llama folder; and the tokenizer that goes with a run. `ddpkit generate` and `ddpkit export` stand on it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ddpkit import config as config_mod
from ddpkit import models
from ddpkit.checkpoint import check_file, load_checkpoint
from ddpkit.checkpoint.sharded import is_sharded, read_model
from ddpkit.data.text.tokenizer import FILE, read_file
from ddpkit.errors import UserError
from ddpkit.models import MODEL_FAMILIES, family_of_module
from ddpkit.models.hf import is_hf_folder, load_folder, load_into

NAMES = ("best.pt", "best.dcp", "last.pt", "last.dcp")


@dataclass
class Loaded:
    """A model read from disk: the model, the checkpoint it came from, its tokenizer's JSON text (or None)."""

    model: nn.Module
    source: Path
    tokenizer: str | None


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself when it is a checkpoint; in a run directory (or its checkpoints/ folder) the best checkpoint,
    else the last; UserError when there is none."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_file() or is_sharded(p):
        return p
    if not p.exists():
        raise UserError(f"'{path}' does not exist", "give a run directory (out_dir) or a checkpoint in it")
    if not p.is_dir():
        check_file(p)  # a FIFO or device: named as what it is
    for folder in (p / "checkpoints", p):
        for name in NAMES:
            if (folder / name).is_file() or is_sharded(folder / name):
                return folder / name
    raise UserError(
        f"'{path}' holds no checkpoint (checkpoints/best.pt or last.pt, .dcp)",
        "train first (ddpkit train out_dir=...), or give the checkpoint's path",
    )


def from_checkpoint(path: str | os.PathLike) -> Loaded:
    """The language model of a ddpkit checkpoint (any layout it was trained in), on one process."""
    source = find_checkpoint(path)
    state = load_checkpoint(source, map_location="cpu", require=("model", "config"))
    cfg = config_mod.load_config(None, [], base=state["config"])
    family = models.model_family(cfg.model.arch)
    if not family.tokens:
        raise UserError(
            f"checkpoint '{source}' is of model.arch={cfg.model.arch}, an image classifier, not a language model",
            f"give the checkpoint of a run with model.arch={' or '.join(models.language_models())}",
        )
    sd = read_model(source) if is_sharded(source) else state["model"]
    if "tok_emb.weight" not in sd:
        raise UserError(
            f"checkpoint '{source}' has no token embedding (tok_emb.weight)", "give a whole model's"
        )
    vocab = sd["tok_emb.weight"].shape[0]
    model = family.build_lm(cfg.model.arch, vocab, cfg.data.block_size, cfg.model)

    load_into(model, sd, f"checkpoint '{source}'")
    tok = state.get("tokenizer")
    if not isinstance(tok, str):
        for run in (source.parent.parent, source.parent):
            if (run / FILE).is_file():
                tok = read_file(run / FILE, "the run's tokenizer")
                break
        else:
            tok = None
    return Loaded(model.eval(), source, tok)


def from_hf(path: str | os.PathLike) -> nn.Module:
    """The model of the family whose Hugging Face converter reads the folder (the built-in GPT for GPT-2's, the
    Llama for Llama's), holding the folder's weights."""
    family, shape, sd = load_folder(path, MODEL_FAMILIES.entries())
    model = family.hf.build(**shape)
    load_into(model, sd, f"'{path}'")
    return model.eval()


def load(path: str | os.PathLike) -> Loaded:

    if is_hf_folder(path):
        return Loaded(from_hf(path), Path(path), None)
    return from_checkpoint(path)


def load_model(path: str | os.PathLike) -> nn.Module:
    """The model, in eval mode on the CPU, from a ddpkit checkpoint (.pt, .dcp or a run directory) or a Hugging
    Face folder (config.json + model.safetensors, single or sharded) of the GPT-2 or Llama architecture."""
    return load(path).model


def init_from(model: nn.Module, path: str, report: Any = None) -> None:
    """model.init_from: a Hugging Face folder's weights into the freshly built `model` (shapes must agree)."""
    if not is_hf_folder(path):
        raise UserError(
            f"model.init_from '{path}' is not a Hugging Face folder (no config.json in it)",
            "give a folder written by save_pretrained or by ddpkit export --to hf",
        )
    family, shape, sd = load_folder(path, MODEL_FAMILIES.entries())
    settings = [k for k in shape if k not in ("vocab_size", "block_size")]
    if family_of_module(model) is not family:
        raise UserError(
            f"model.init_from '{path}' holds a {family.name} model, not a {type(model).__name__}",
            f"set model.arch={family.name}",
        )
    for key in settings:  # the shape decides the tensors; these change what they compute
        if getattr(model, key, None) != shape[key]:
            raise UserError(
                f"model.init_from '{path}' has {key}={shape[key]} but this config gives {getattr(model, key, None)}",
                f"set model.{key}={str(shape[key]).lower()}",
            )
    load_into(model, sd, f"model.init_from '{path}'")
    if report is not None:
        report(f"model.init_from: every tensor from {path}")
