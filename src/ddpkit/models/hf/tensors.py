"""A Hugging Face folder's tensors as the model's, through its family's table (`HFConverter.tensors`: each model
tensor's folder tensor, transposed or a part of one): checked against the folder's headers before any tensor is
read (every folder tensor used or `ignored`, none missing, floating-point dtypes, the shapes the table implies, the
total size against this machine's memory), then read whole or as the box one rank holds (a sharded layout reads
only its slices: safetensors' `get_slice` reads just those bytes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ddpkit.errors import UserError
from ddpkit.models.family import HFConverter, HFTensor
from ddpkit.models.hf.files import HINT, UNUSED_HINT, Entry, check_dtypes
from ddpkit.models.hf.values import refuse_size

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def listed(names: Sequence[str], most: int = 3) -> str:
    """'a, b, c and 5 more'."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class FolderTensors:
    """The model's tensors in folder `folder` (its headers `entries`), by the model's names: `table` from the
    family's converter for config `cfg`. Constructing it checks everything that can be checked without reading a
    tensor; `read` then reads one tensor, or one box of it."""

    def __init__(self, folder: Path, entries: dict[str, Entry], conv: HFConverter, cfg: Any):
        self.folder, self.label = folder, conv.label
        self.table: dict[str, HFTensor] = conv.tensors(cfg.model)
        self.found = {conv.rename(name): name for name in entries}  # the table's names -> the folder's
        used = sorted({n for t in self.table.values() for n in t.names})
        missing = [n for n in used if n not in self.found]
        if missing:
            raise UserError(
                f"'{folder}' lacks tensor {listed(missing)} that its config.json's {self.label} holds", HINT
            )
        patterns = [re.compile(p) for p in conv.ignored(cfg.model)]
        unused = [n for n in sorted(self.found) if n not in used and not any(p.search(n) for p in patterns)]
        if unused:
            raise UserError(
                f"'{folder}' holds {len(unused)} tensors that the {self.label} its config.json describes does not "
                f"use: {listed(unused)}",
                UNUSED_HINT,
            )
        self.entries = {n: entries[self.found[n]] for n in used}
        check_dtypes(entries, [self.found[n] for n in used], folder)
        refuse_size(sum(e.numel for e in self.entries.values()), folder)
        self.shapes = {ours: self._shape(ours, t) for ours, t in self.table.items()}

    def _shape(self, ours: str, t: HFTensor) -> tuple[int, ...]:
        """The model tensor's shape: the folder tensor's, transposed, of which one of `parts` along dim 0; of
        `stacked` ones (each the same shape), their number before it."""
        if t.stacked:
            shapes = {tuple(self.entries[n].shape) for n in t.names}
            if len(shapes) > 1:
                raise UserError(f"'{self.folder}': tensors {t.name.format('N')} differ in shape", HINT)
            one = self._shape(ours, HFTensor(t.names[0], t.transposed))
            return (t.stacked, *one)
        shape = list(self.entries[t.name].shape)
        if t.transposed:
            if len(shape) != 2:
                raise UserError(
                    f"'{self.folder}': tensor {t.name} is {tuple(shape)}, where a matrix belongs", HINT
                )
            shape.reverse()
        if t.parts > 1 and (not shape or shape[0] % t.parts):
            raise UserError(
                f"'{self.folder}': tensor {t.name} is {tuple(self.entries[t.name].shape)}, which does not split "
                f"into {t.parts} equal parts",
                HINT,
            )
        if t.parts > 1:
            shape[0] //= t.parts
        return tuple(shape)

    def dtype(self, ours: str) -> torch.dtype:
        return DTYPES[self.entries[self.table[ours].names[0]].dtype]

    def read(
        self, ours: str, offsets: Sequence[int] | None = None, lengths: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The model's tensor `ours` (in the folder's dtype), or its box at `offsets` of `lengths`; only that box
        of the file is read."""
        t, shape = self.table[ours], self.shapes[ours]
        offsets = list(offsets) if offsets is not None else [0] * len(shape)
        lengths = list(lengths) if lengths is not None else list(shape)
        if t.stacked:  # the box's first dimension picks the folder tensors, the rest is a box of each
            one = [
                HFTensor(t.name.format(i), t.transposed) for i in range(offsets[0], offsets[0] + lengths[0])
            ]
            parts = [self._read(each, offsets[1:], lengths[1:], 0) for each in one]
            return torch.stack(parts) if parts else torch.empty(lengths, dtype=self.dtype(ours))
        return self._read(t, offsets, lengths, shape[0] if shape else 0)

    def _read(self, t: HFTensor, offsets: list[int], lengths: list[int], rows: int) -> torch.Tensor:
        """The box at `offsets` of `lengths` of the model's tensor (`rows` long) that folder tensor `t` holds."""
        box = [slice(o, o + n) for o, n in zip(offsets, lengths, strict=True)]
        if box:
            first = t.part * rows
            box[0] = slice(first + box[0].start, first + box[0].stop)
        if t.transposed:
            box.reverse()
        # its file mapped for this read alone: the pages of a mapped file count in the process's resident memory
        # until it is unmapped, so the files held open while each rank read its slices of every tensor kept
        # 440 MiB of them on each of 8 ranks (benchmarks/RESULTS.md §21)
        with safe_open(self.entries[t.name].file, framework="pt") as fh:
            name = self.found[t.name]
            value = fh.get_slice(name)[tuple(box)] if box else fh.get_tensor(name)
        return value.t().contiguous() if t.transposed else value


def check_model(tensors: FolderTensors, own: dict[str, torch.Tensor], where: str) -> None:
    """The model's tensors `own` (its state dict) are the table's, shape for shape: a UserError naming the first
    that differs (before any tensor is read)."""
    extra = [n for n in own if n not in tensors.table]
    lacking = [n for n in tensors.table if n not in own]
    if extra or lacking:
        what = f"has no {listed(extra)}" if extra else f"holds {listed(lacking)}, which this model lacks"
        raise UserError(f"{where} {what}", "build the model the folder's config.json describes")
    for name, value in own.items():
        if tuple(value.shape) != tensors.shapes[name]:
            raise UserError(
                f"{where}: tensor {name} is {tensors.shapes[name]} but this model's is {tuple(value.shape)}",
                "leave the model's shape keys out with model.init_from: the folder's are the defaults",
            )


@torch.no_grad()
def fill(model: torch.nn.Module, tensors: FolderTensors, where: str) -> None:
    """Every tensor of `model` (whole tensors on this process) from the folder, one tensor at a time."""
    own = model.state_dict()
    check_model(tensors, own, where)
    for name, value in own.items():
        value.copy_(tensors.read(name))
