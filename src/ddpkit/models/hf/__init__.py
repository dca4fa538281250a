"""Hugging Face weights in and out, with safetensors (no pickle): a folder of `config.json` and `model.safetensors`
(or `model.safetensors.index.json` and its shards). What is a model family's own (the config.json `model_type` it
reads, which config.json values are which config keys, where each of its tensors lies in the folder) is the
family's `HFConverter` (ModelFamily.hf, next to the model); this package reads and writes the folder and asks the
families it is given, naming none. transformers itself is never imported here.

Every reader validates before it allocates: files.py (the files as hostile input: bounded JSON, regular files,
headers, weight dtypes), values.py (config.json's values by the config keys' own rules, and the model's size
against this machine's memory), tensors.py (the folder's tensors against the family's table: none unused, none
missing; read whole or as one rank's slices), storage.py (the folder as a torch.distributed.checkpoint source, so
every layout's sharded load reads only its slices), write.py (export, streamed, sharded with an index).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ddpkit.errors import UserError, first_line
from ddpkit.models.family import HFConverter, ModelFamily
from ddpkit.models.hf.files import (
    CONFIG,
    HINT,
    INDEX,
    UNUSED_HINT,
    WEIGHTS,
    check_dtypes,
    is_hf_folder,
    read_config,
    read_headers,
)
from ddpkit.models.hf.tensors import FolderTensors, fill, listed
from ddpkit.models.hf.values import family_for, folder_config, folder_defaults
from ddpkit.models.hf.write import (
    DEFAULT_SHARD,
    Planned,
    folder_json,
    planned_tensors,
    shard_bytes,
    write_folder,
)

__all__ = [
    "CONFIG",
    "HINT",
    "INDEX",
    "WEIGHTS",
    "Folder",
    "converter",
    "export",
    "folder_defaults",
    "is_hf_folder",
    "load_into",
    "need",
    "open_folder",
    "read_config",
    "read_tensors",
    "refuse",
]


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


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names (each a regular file,
    every tensor a floating-point one)."""
    entries = read_headers(Path(folder))
    check_dtypes(entries, list(entries), Path(folder))
    out: dict[str, torch.Tensor] = {}
    for file in sorted({e.file for e in entries.values()}):
        try:
            with safe_open(file, framework="pt") as fh:
                out.update({name: fh.get_tensor(name) for name in fh.keys()})
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read '{file}': {first_line(e, joined=True)}", HINT) from None
    return out


class _Asked(dict):
    """The folder's tensors, counting which a converter's `to_ours` asked for (the rest are refused, not
    dropped)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__(tensors)
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.asked.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)


@dataclass
class Folder:
    """A Hugging Face folder, checked: the family that reads it and, for a declared converter, the Config its
    config.json makes and its tensors (FolderTensors); for a converter of functions, build's arguments."""

    path: Path
    family: ModelFamily
    cfg: Any = None
    tensors: FolderTensors | None = None
    shape: dict[str, Any] | None = None

    @property
    def hf(self) -> HFConverter:
        return self.family.hf

    def tensors_or_refuse(self) -> FolderTensors:
        """The folder's tensors by the model's names; a UserError for a family that reads its folder whole."""
        if self.tensors is None:
            raise UserError(
                f"'{self.path}' holds a {self.hf.label} model, whose family reads its folder whole",
                "a sharded layout reads a folder of a family whose HFConverter declares keys and tensors",
            )
        return self.tensors

    def build(self) -> torch.nn.Module:
        """The model config.json describes, with its random initial weights."""
        if self.cfg is None:
            return self.hf.build(**self.shape)
        m = self.cfg.model
        return self.family.build_lm(m.arch, self.cfg.data.vocab_size, self.cfg.data.block_size, m)

    def into(self, model: torch.nn.Module, where: str) -> None:
        """The folder's weights into `model` (whole tensors on this process), strictly: a tensor of the folder
        that the model does not use, or one it lacks, is refused before any is copied."""
        if self.tensors is not None:
            fill(model, self.tensors, where)
            return
        tensors = _Asked(read_tensors(self.path))
        try:
            sd = self.hf.to_ours(tensors, self.shape)
        except KeyError as e:
            raise UserError(
                f"'{self.path}' has no tensor {e} that its config.json's model holds", HINT
            ) from None
        unused = sorted(set(tensors) - tensors.asked)
        if unused:
            raise UserError(
                f"'{self.path}' holds {len(unused)} tensors the {self.hf.label} does not use: {listed(unused)}",
                UNUSED_HINT,
            )
        load_into(model, {k: v.contiguous() for k, v in sd.items()}, where)


def open_folder(path: str | os.PathLike, families: Iterable[ModelFamily]) -> Folder:
    """Hugging Face folder `path` checked before anything is allocated: its family (by model_type among
    `families`: the registry's entries), config.json's values by the config keys' rules, and, for a declared
    converter, every tensor's name, dtype and shape from the headers. UserError otherwise."""
    folder = Path(path)
    raw = read_config(folder)
    family = family_for(raw, folder, families)
    if not family.hf.declared:
        try:
            return Folder(folder, family, shape=family.hf.shape(raw, folder))
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # a converter of its own, a bad value
            raise UserError(
                f"'{folder / CONFIG}' is not one its family reads: {first_line(e)}", HINT
            ) from None
    cfg = folder_config(family, raw, folder / CONFIG)
    return Folder(folder, family, cfg, FolderTensors(folder, read_headers(folder), family.hf, cfg))


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


def export(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    family: ModelFamily | None,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    read: Any = None,
) -> Path:
    """Write `model` (of `family`, whose converter names its tensors) as a Hugging Face folder: config.json and
    its tensors in `dtype`, in safetensors files of at most `max_shard_size` with an index when there are
    several. `read(name)`: where the model's tensors come from when it holds none itself (a model on the meta
    device, its checkpoint read tensor by tensor); default its own."""
    hf = converter(family, model)
    max_bytes = shard_bytes(max_shard_size or DEFAULT_SHARD)
    sd = model.state_dict()
    read = read or (lambda name: sd[name].detach())
    if hf.declared:
        table = hf.tensors(model)
        lacking = sorted(set(sd) - set(table))
        if lacking:
            raise UserError(
                f"the {hf.label} converter has no name for tensor {listed(lacking)}", "report this"
            )
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        planned = planned_tensors(table, shapes, read, dtype)
        config = folder_json(hf, model, dtype)
    else:
        theirs = hf.to_theirs(model)
        planned = [
            Planned(k, tuple(v.shape), dtype, lambda v=v: v.detach()) for k, v in sorted(theirs.items())
        ]
        written = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        config = {"bos_token_id": None, "eos_token_id": None, **hf.config(model), "torch_dtype": written}
    out = Path(out_dir)
    write_folder(out, config, planned, max_bytes)
    return out
