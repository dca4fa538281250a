"""A model written as a Hugging Face folder: config.json and its tensors in safetensors files of at most
`max_shard_size` bytes each (one `model.safetensors`, or `model-0000K-of-0000N.safetensors` and the index
`model.safetensors.index.json` that transformers writes), float32 or bfloat16.

The tensors are streamed: each file's header is computed from the shapes alone, then each tensor is made (read
from the checkpoint, joined and transposed as the family's table says), written and dropped, so the writer holds
one tensor at a time, never a whole shard or the whole model (safetensors' own `save_file` would hold a shard and
a second copy of its bytes). The folder is written under a temporary name beside OUT_DIR and renamed into place
once complete, so a failure leaves no half-written folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomicio import fsync_dir, umask
from ddpkit.errors import UserError
from ddpkit.models.hf.files import CONFIG, INDEX, WEIGHTS

DEFAULT_SHARD = "5GB"  # transformers 4's default, what the Hub serves well
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def shard_bytes(text: str) -> int:
    """`--max-shard-size`: bytes from '5GB', '500MB', '2GiB' or a plain number (transformers' spelling); a
    UserError for anything else, or for less than 1 kB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if m is None or m.group(2) not in _UNITS:
        raise UserError(
            f"--max-shard-size {text!r} is not a size", "write it as 5GB, 500MB, 2GiB or a number of bytes"
        )
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not 1000 <= size <= 10**15:
        raise UserError(f"--max-shard-size {text!r} is {size:,} bytes", "give between 1KB and 1000TB")
    return size


@dataclass(frozen=True)
class Planned:
    """One tensor of the folder: its name there, shape and dtype, and how to make it (when its turn comes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


def shards(planned: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """The tensors in order, cut into files of at most `max_bytes` (a larger tensor alone in its file)."""
    out: list[list[Planned]] = [[]]
    size = 0
    for p in planned:
        if out[-1] and size + p.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


def _header(items: list[Planned]) -> bytes:
    """The safetensors header of `items` laid out in order: 8 bytes of length, then JSON padded to 8 bytes."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for p in items:
        head[p.name] = {
            "dtype": SAFETENSORS_DTYPES[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [start, start + p.nbytes],
        }
        start += p.nbytes
    text = json.dumps(head, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_file(path: Path, items: list[Planned]) -> None:
    with open(path, "wb") as fh:
        fh.write(_header(items))
        for p in items:
            value = p.make().to(p.dtype).contiguous()
            if tuple(value.shape) != p.shape:
                raise UserError(
                    f"tensor {p.name} came out {tuple(value.shape)}, not {p.shape}", "report this"
                )
            fh.write(value.reshape(-1).view(torch.uint8).numpy().data)
            del value
        fh.flush()
        os.fsync(fh.fileno())


def write_folder(out: Path, config: dict[str, Any], planned: list[Planned], max_bytes: int) -> list[str]:
    """`out` (absent or an empty folder) made a Hugging Face folder of `config` and the `planned` tensors; the
    names of the files written."""
    parts = shards(planned, max_bytes)
    names = (
        [WEIGHTS]
        if len(parts) == 1
        else [f"model-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for name, items in zip(names, parts, strict=True):
            _write_file(tmp / name, items)
        if len(parts) > 1:
            index = {
                "metadata": {"total_size": sum(p.nbytes for p in planned)},
                "weight_map": {p.name: name for name, items in zip(names, parts, strict=True) for p in items},
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's folder is the owner's alone
        fsync_dir(tmp)
        if out.is_dir():
            out.rmdir()  # empty (the command checked): the complete folder takes its place
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names + ([INDEX] if len(parts) > 1 else []) + [CONFIG]


def _set(tree: dict[str, Any], name: str, value: Any) -> None:
    *parents, leaf = name.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def folder_json(conv: Any, model: Any, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a declared converter: `extra`, then each key's value under all its names: the model's
    attribute of the key's name (a family's model keeps each key it was built with, resolved: a SwiGLU width
    left null is the width it has)."""
    out: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    for name, value in conv.extra(model).items():
        _set(out, name, value)
    for h in conv.keys:
        value = getattr(model, h.key.rpartition(".")[2])
        if h.values:
            value = next(theirs for theirs, ours in h.values if ours == value)
        for name in h.names:
            _set(out, name, value)
    written = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return {**out, "model_type": conv.model_type, "dtype": written, "torch_dtype": written}


def planned_tensors(
    table: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    read: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
) -> list[Planned]:
    """The folder's tensors from the model's (`shapes`, `read` one by name) through the family's table: the parts
    of one folder tensor joined along the first dimension, then transposed; a stacked tensor cut into its folder
    tensors (the model's read once for all of them); a tensor two model names share (a tied head) written once."""
    by_theirs: dict[str, dict[int, tuple[str, Any]]] = {}
    planned = []
    for ours, t in table.items():
        if t.stacked:
            planned += _unstacked(ours, t, shapes[ours], read, dtype)
        else:
            by_theirs.setdefault(t.name, {}).setdefault(t.part, (ours, t))
    for theirs, parts in by_theirs.items():
        order = [parts[i] for i in sorted(parts)]
        first, t = order[0]
        shape = [sum(shapes[o][0] for o, _ in order), *shapes[first][1:]]
        if t.transposed:
            shape.reverse()

        def make(order=order, t=t) -> torch.Tensor:
            value = torch.cat([read(o) for o, _ in order]) if len(order) > 1 else read(order[0][0])
            return value.t() if t.transposed else value

        planned.append(Planned(theirs, tuple(shape), dtype, make))
    return sorted(planned, key=lambda p: p.name)


def _unstacked(
    ours: str, t: Any, shape: tuple[int, ...], read: Callable, dtype: torch.dtype
) -> list[Planned]:
    """The folder tensors of a stacked model tensor `ours`: its slices along the first dimension."""
    kept: dict[str, Any] = {"left": t.stacked}  # the model's tensor, held until its last slice is made

    def slice_of(i: int) -> torch.Tensor:
        if "value" not in kept:
            kept["value"] = read(ours)
        value, kept["left"] = kept["value"][i], kept["left"] - 1
        if not kept["left"]:
            del kept["value"]
        return value.t() if t.transposed else value

    each = list(shape[1:])[:: -1 if t.transposed else 1]
    return [Planned(name, tuple(each), dtype, lambda i=i: slice_of(i)) for i, name in enumerate(t.names)]
