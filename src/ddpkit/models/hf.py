"""Hugging Face weights in and out, with safetensors (no pickle): a folder of `config.json` and `model.safetensors`
(or `model.safetensors.index.json` and its shards). What is a model family's own (which config.json `model_type`
it reads, its constructor arguments, its tensors' names) is the family's `HFConverter` (ModelFamily.hf, next to
the model); this module reads and writes the folder and asks the families it is given, naming none. transformers
itself is never imported here: the folder's format is plain JSON and safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomicio import atomic_write
from ddpkit.config.bounded import loads_json
from ddpkit.errors import UserError, first_line
from ddpkit.models.family import HFConverter, ModelFamily

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
HINT = (
    "give a folder saved by transformers' save_pretrained (config.json + model.safetensors) of an architecture "
    "a model family reads"
)


def is_hf_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_config(folder: Path) -> dict[str, Any]:

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


def need(cfg: dict, key: str, folder: Path) -> int:
    """config.json's positive integer `key` (a converter's `shape` reads its sizes with it); UserError if none."""
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"'{folder / CONFIG}' has no positive integer '{key}'", HINT)
    return value


def refuse(unsupported: list[tuple[Any, str]], folder: Path, model: str) -> None:
    """A UserError for the first (bad, what) whose `bad` holds: what config.json asks that `model` cannot hold."""
    for bad, what in unsupported:
        if bad:
            raise UserError(
                f"'{folder / CONFIG}' asks for {what}, which the built-in {model} does not hold", HINT
            )


def load_folder(
    path: str | os.PathLike, families: Iterable[ModelFamily]
) -> tuple[ModelFamily, dict[str, Any], dict[str, torch.Tensor]]:
    """(the family whose converter reads the folder's model_type, build's arguments, the model's state dict)
    from a Hugging Face folder; UserError when none of `families` reads it."""
    folder = Path(path)
    cfg = read_config(folder)
    kind = cfg.get("model_type")
    readers = [f for f in families if f.hf is not None]
    family = next((f for f in readers if f.hf.model_type == kind), None)
    if family is None:
        known = " and ".join(f"{f.hf.label} ({f.hf.model_type})" for f in readers)
        raise UserError(
            f"'{folder}' holds a model of type '{kind}'; ddpkit reads the {known} architectures", HINT
        )
    shape = family.hf.shape(cfg, folder)
    tensors = read_tensors(folder)
    try:
        sd = family.hf.to_ours(tensors, shape)
    except KeyError as e:
        raise UserError(f"'{folder}' has no tensor {e} that its config.json's model holds", HINT) from None
    return family, shape, {k: v.contiguous() for k, v in sd.items()}


def converter(family: ModelFamily | None, model: torch.nn.Module) -> HFConverter:
    """`family`'s Hugging Face converter; UserError when the model's family has none."""
    if family is None or family.hf is None:
        raise UserError(
            f"a {type(model).__name__} has no Hugging Face format",
            "export a model whose family declares one (ModelFamily.hf)",
        )
    return family.hf


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


def export(model: torch.nn.Module, out_dir: str | os.PathLike, family: ModelFamily | None) -> Path:
    """Write `model` (of `family`, whose converter names its tensors) as a Hugging Face folder: config.json and
    model.safetensors, in float32."""
    hf = converter(family, model)
    cfg = {"bos_token_id": None, "eos_token_id": None, **hf.config(model), "torch_dtype": "float32"}
    tensors = {k: v.detach().float().contiguous().clone() for k, v in hf.to_theirs(model).items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda fh: fh.write(_safetensors_bytes(tensors)))
    atomic_write(out / CONFIG, lambda fh: fh.write(json.dumps(cfg, indent=2).encode("utf-8")))
    return out


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})
