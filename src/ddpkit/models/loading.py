"""`ddpkit.load_model(path)`: a language model, in eval mode on the CPU, from a ddpkit checkpoint (a `.pt` file, a
sharded `.dcp` folder, or a run directory: its best checkpoint, else its last) or from a Hugging Face folder of an
architecture a family reads; `model.init_from`'s weights, whole on one process or each rank's slices under a
sharded layout; and a checkpoint exported as a Hugging Face folder, tensor by tensor. `ddpkit generate` and
`ddpkit export` stand on it. Every reader is strict: a tensor the model does not use, or one it lacks, is refused
in one line naming it, never dropped."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit import config as config_mod
from ddpkit import models
from ddpkit.checkpoint import check_file, load_checkpoint
from ddpkit.checkpoint.sharded import is_sharded, model_shapes, read_tensor
from ddpkit.data.text.tokenizer import FILE, read_file
from ddpkit.errors import UserError, first_line
from ddpkit.models import family_of_module
from ddpkit.models.hf import export, is_hf_folder, open_folder
from ddpkit.models.hf.storage import FolderReader, FolderSource  # declares the DCP reader of a folder
from ddpkit.models.hf.tensors import check_model, listed
from ddpkit.models.hf.write import EXPORT_DTYPES, shard_bytes

NAMES = ("best.pt", "best.dcp", "last.pt", "last.dcp")
INIT_HINT = "leave the model's shape keys out with model.init_from: the folder's config.json gives them"


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


@dataclass
class Checkpoint:
    """A language model's checkpoint opened without reading its tensors: its config and family, each tensor's
    shape, and `read(name)`, one tensor (a sharded folder reads just that one)."""

    source: Path
    state: dict[str, Any]
    cfg: Any
    family: Any
    shapes: dict[str, tuple[int, ...]]
    read: Callable[[str], torch.Tensor]

    def build(self, device: Any = None) -> nn.Module:
        """The checkpoint's model, with random weights (on `device`: "meta" builds only the shapes)."""
        vocab = self.shapes[self.family.vocab_tensor][0]
        with torch.device(device or "cpu"):
            return self.family.build_lm(self.cfg.model.arch, vocab, self.cfg.data.block_size, self.cfg.model)

    def tokenizer(self) -> str | None:
        """The tokenizer kept in the checkpoint, else its run's tokenizer.json, else None."""
        tok = self.state.get("tokenizer")
        if isinstance(tok, str):
            return tok
        for run in (self.source.parent.parent, self.source.parent):
            if (run / FILE).is_file():
                return read_file(run / FILE, "the run's tokenizer")
        return None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A language model's checkpoint (any layout it was trained in) opened on one process: its side state and
    its tensors' shapes, none of a sharded folder's tensors read yet."""
    source = find_checkpoint(path)
    state = load_checkpoint(source, map_location="cpu", require=("model", "config"))
    cfg = config_mod.load_config(None, [], base=state["config"])
    family = models.model_family(cfg.model.arch, cfg.model)
    if not family.tokens:
        raise UserError(
            f"checkpoint '{source}' is of model.arch={cfg.model.arch}, an image classifier, not a language model",
            f"give the checkpoint of a run with model.arch={' or '.join(models.language_models())}",
        )
    if is_sharded(source):
        shapes = model_shapes(source)
        read: Callable[[str], torch.Tensor] = lambda name: read_tensor(source, name)  # noqa: E731
    else:
        sd = state["model"]
        shapes, read = {k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__
    if family.vocab_tensor not in shapes:
        raise UserError(
            f"checkpoint '{source}' has no {family.vocab_tensor}, the token embedding of a {family.name} model",
            "give a whole model's checkpoint",
        )
    return Checkpoint(source, state, cfg, family, shapes, read)


def check_checkpoint(ckpt: Checkpoint, own: dict[str, torch.Tensor]) -> None:
    """The checkpoint holds exactly the model's tensors, shape for shape: a UserError naming the first that is
    extra, missing or of another shape (before any tensor is read)."""
    extra = sorted(set(ckpt.shapes) - set(own))
    lacking = sorted(set(own) - set(ckpt.shapes))
    hint = "give a checkpoint of the model its config.yaml describes"
    if extra or lacking:
        what = f"holds {listed(extra)}, which the model does not use" if extra else f"lacks {listed(lacking)}"
        raise UserError(f"checkpoint '{ckpt.source}' {what}", hint)
    for name, value in own.items():
        if ckpt.shapes[name] != tuple(value.shape):
            raise UserError(
                f"checkpoint '{ckpt.source}': tensor {name} is {ckpt.shapes[name]}, the model's {tuple(value.shape)}",
                hint,
            )


def from_checkpoint(path: str | os.PathLike) -> Loaded:
    """The language model of a ddpkit checkpoint (any layout it was trained in), on one process."""
    ckpt = open_checkpoint(path)
    model = ckpt.build()
    own = model.state_dict()
    check_checkpoint(ckpt, own)
    with torch.no_grad():
        for name, value in own.items():
            value.copy_(ckpt.read(name))
    return Loaded(model.eval(), ckpt.source, ckpt.tokenizer())


def export_checkpoint(path: str | os.PathLike, out: Path, dtype: str, max_shard_size: str | None) -> Loaded:
    """A checkpoint written as a Hugging Face folder `out` with weights of `dtype` (fp32, bf16), tensor by tensor:
    a sharded checkpoint is never gathered (its model is built on the meta device, for its shapes and
    config.json alone)."""
    if max_shard_size is not None:
        shard_bytes(max_shard_size)  # checked before anything is read
    ckpt = open_checkpoint(path)
    model = ckpt.build("meta")
    check_checkpoint(ckpt, model.state_dict())
    export(model, out, ckpt.family, dtype=EXPORT_DTYPES[dtype], max_shard_size=max_shard_size, read=ckpt.read)
    return Loaded(model, ckpt.source, ckpt.tokenizer())


# A model that load_model built on the meta device (called under `with torch.device("meta")`, or by a builder that
# ddpkit.prepare calls there): the folder whose values it takes once it is laid out, each rank reading only its
# slices (FolderSource.pieces). Written here, read through `values_of` by what gives a meta model memory.
_VALUES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def values_of(model: nn.Module) -> Any:
    """The values a model built on the meta device by load_model takes (a FolderSource), or None."""
    return _VALUES.get(model)


def from_hf(path: str | os.PathLike) -> nn.Module:
    """The model of the family whose Hugging Face converter reads the folder, holding the folder's weights (every
    check made before the model is built). Built on the meta device (the current device being meta), it holds
    none yet: `values_of(model)` gives them, to be read as the model is laid out."""
    folder = open_folder(path, models.MODEL_FAMILIES.entries())
    model = folder.build()
    if any(t.is_meta for t in model.state_dict().values()):
        tensors = folder.tensors_or_refuse()  # a family that reads its folder whole cannot fill shards
        check_model(tensors, model.state_dict(), f"'{path}'")
        _VALUES[model] = FolderSource(tensors)
    else:
        folder.into(model, f"'{path}'")
    return model.eval()


def load(path: str | os.PathLike) -> Loaded:
    """The model of a Hugging Face folder or a ddpkit checkpoint, with where it came from and its tokenizer."""
    if is_hf_folder(path):
        return Loaded(from_hf(path), Path(path), None)
    return from_checkpoint(path)


def load_model(path: str | os.PathLike) -> nn.Module:
    """The model, in eval mode on the CPU, from a ddpkit checkpoint (.pt, .dcp or a run directory) or a Hugging
    Face folder (config.json + model.safetensors, single or sharded) of an architecture a family reads."""
    return load(path).model


def _folder_for(model: nn.Module, path: str) -> Any:
    """Folder `path` opened, its family `model`'s and its settings the model's (UserError naming both values)."""
    if not is_hf_folder(path):
        raise UserError(
            f"model.init_from '{path}' is not a Hugging Face folder (no config.json in it)",
            "give a folder written by save_pretrained or by ddpkit export --to hf",
        )
    folder = open_folder(path, models.MODEL_FAMILIES.entries())
    if family_of_module(model) is not folder.family:
        raise UserError(
            f"model.init_from '{path}' holds a {folder.family.name} model, not a {type(model).__name__}",
            f"set model.arch={folder.family.name}",
        )
    if folder.cfg is not None:
        settings = {h.key.rpartition(".")[2]: h.key for h in folder.hf.keys}
        given = {n: getattr(getattr(folder.cfg, k.rpartition(".")[0]), n) for n, k in settings.items()}
    else:
        given = {k: v for k, v in folder.shape.items() if k not in ("vocab_size", "block_size")}
    # the tensors' shapes are checked next; these change what they compute (a null one is the key's default, which
    # the model resolves as it was built from it: a head_dim left null is n_embd / n_head)
    for key, value in given.items():
        if value is None or key in ("vocab_size", "block_size"):
            continue
        if hasattr(model, key) and getattr(model, key) != value:
            raise UserError(
                f"model.init_from '{path}' has {key}={value} but this config gives {getattr(model, key)}",
                f"set model.{key}={str(value).lower()}",
            )
    return folder


def init_from(model: nn.Module, path: str, report: Any = None) -> Any:
    """model.init_from: Hugging Face folder `path` checked against `model` (its family, settings and every
    tensor's name and shape); a model with memory is filled whole here. Returns the folder's values
    (models/hf/storage.py FolderSource): a model built on the meta device takes them once it is laid out, each
    rank reading only the slices it holds (`pieces`), or one whole tensor at a time (as a Mapping)."""
    folder, where = _folder_for(model, path), f"model.init_from '{path}'"
    if any(t.is_meta for t in model.state_dict().values()):
        if folder.tensors is None:
            raise UserError(f"{where} is read whole by its family's converter", "build the model on the CPU")
        check_model(folder.tensors, model.state_dict(), where)
        return FolderSource(folder.tensors)
    folder.into(model, where)
    if report is not None:
        report(f"model.init_from: every tensor from {path}")
    return FolderSource(folder.tensors) if folder.tensors is not None else None


def init_sharded(strategy: Any, wrapped: nn.Module, path: str, report: Any = None) -> None:
    """model.init_from under any layout: the folder read as a sharded checkpoint by the strategy that laid the
    model out (`Strategy.load_sharded`), so each rank reads only the slices it holds. Collective."""
    folder = FolderReader(path)
    total = sum(e.numel for e in folder.tensors.entries.values())  # every check of the folder, before reading
    before = FolderReader.READ.get(folder.folder, 0)
    try:
        strategy.load_sharded(wrapped, None, path, {})
    except (KeyError, ValueError) as e:
        raise UserError(
            f"model.init_from '{path}' does not fit this model: {first_line(e, limit=40)}", INIT_HINT
        ) from None
    if report is not None:
        read = FolderReader.READ.get(folder.folder, 0) - before
        report(
            f"model.init_from: every tensor from {path} ({read:,} of its {total:,} values read on this rank)"
        )
