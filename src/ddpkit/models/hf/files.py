"""A Hugging Face folder's files read as hostile input, before any tensor is: config.json and the index as bounded
JSON (a size read no further than its bound, a nesting depth measured on the text), every file a regular file
inside the folder (a FIFO is named, never waited on), each safetensors file's header (names, shapes, dtypes) read
through safetensors' own checks, and only the dtypes a weight may have."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ddpkit.atomicio import NotRegularFile, check_regular, open_regular
from ddpkit.config.bounded import loads_json
from ddpkit.errors import UserError, first_line

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20  # a real config.json is a few kB
MAX_INDEX_BYTES = 64 << 20  # an index names each tensor once: ~100 bytes a tensor, 600,000 tensors
MAX_JSON_DEPTH = 32
# the dtypes a weight may be stored in (safetensors' names); read into the model's float32 (or its own) tensors
WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")
HINT = "give a folder save_pretrained wrote (config.json, model.safetensors) of a family ddpkit reads"

# a folder with tensors its model does not use
UNUSED_HINT = (
    "its tensors are not those of the architecture its model_type names (changed by hand?); give a folder a "
    "model family reads whole: ddpkit leaves no tensor out"
)


@dataclass(frozen=True)
class Entry:
    """One tensor of the folder, from its file's header: the file, its shape and safetensors' dtype name."""

    file: Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def is_hf_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_json(path: Path, max_bytes: int) -> Any:
    """The JSON value in file `path`: a regular file of at most `max_bytes`, nested at most MAX_JSON_DEPTH deep;
    a one-line UserError naming the file and the rule otherwise."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO is refused, never waited on
            raw = fh.read(max_bytes + 1)  # a sparse 30 GB file: 1 MB read, then refused
    except NotRegularFile as e:
        raise UserError(f"'{path}' is {e.strerror}, not a file", HINT) from None
    except OSError as e:
        raise UserError(f"cannot read '{path}': {e.strerror or e}", HINT) from None
    if len(raw) > max_bytes:
        raise UserError(f"'{path}' is larger than {max_bytes >> 20} MiB, more than any real one", HINT)
    try:
        return loads_json(raw.decode("utf-8"), max_depth=MAX_JSON_DEPTH)
    except (ValueError, RecursionError) as e:
        raise UserError(f"cannot read '{path}': {first_line(e, limit=50, joined=True)}", HINT) from None


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json, a JSON object."""
    cfg = read_json(folder / CONFIG, MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise UserError(f"'{folder / CONFIG}' is not a JSON object", HINT)
    return cfg


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(the folder's safetensors files, the index's weight_map or None): model.safetensors, or the shards its
    index names, each a name inside the folder."""
    if (folder / WEIGHTS).is_file() or not (folder / INDEX).exists():
        if not (folder / WEIGHTS).exists():
            raise UserError(f"'{folder}' holds no {WEIGHTS} or {INDEX}", HINT)
        return [folder / WEIGHTS], None
    index = read_json(folder / INDEX, MAX_INDEX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"'{folder / INDEX}' has no weight_map of tensor names to file names", HINT)
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
    if outside:
        raise UserError(f"'{folder / INDEX}' names a file outside the folder: {outside[0]!r}", HINT)
    return [folder / n for n in names], weight_map


def _header(file: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file, from its header alone (safetensors checks it against the file)."""
    try:
        if check_regular(file) is None:  # a FIFO or device is named here; safe_open would block on a FIFO
            raise UserError(f"'{file}' is missing", HINT)
        with safe_open(file, framework="pt") as fh:
            out = {}
            for name in fh.keys():
                part = fh.get_slice(name)
                out[name] = Entry(file, tuple(part.get_shape()), part.get_dtype())
            return out
    except NotRegularFile as e:
        raise UserError(f"'{file}' is {e.strerror}, not a file", HINT) from None
    except (OSError, SafetensorError) as e:
        raise UserError(f"cannot read '{file}': {first_line(e, limit=50, joined=True)}", HINT) from None


def read_headers(folder: Path) -> dict[str, Entry]:
    """Every tensor of the folder (name -> file, shape, dtype), from the headers; each name once, where the
    index says it is."""
    files, weight_map = weight_files(folder)
    entries: dict[str, Entry] = {}
    for file in files:
        for name, entry in _header(file).items():
            if name in entries:
                raise UserError(
                    f"'{folder}' holds tensor {name} twice ({entries[name].file.name}, {file.name})", HINT
                )
            entries[name] = entry
    if weight_map is not None:
        lost = [n for n, f in weight_map.items() if n not in entries or entries[n].file.name != f]
        if lost:
            raise UserError(
                f"'{folder / INDEX}' puts tensor {lost[0]} in {weight_map[lost[0]]}, which does not hold it",
                HINT,
            )
    return entries


def check_dtypes(entries: dict[str, Entry], names: list[str], folder: Path) -> None:
    """The tensors `names` are stored as floating-point numbers: an integer, boolean or 8-bit float tensor where
    a weight belongs is refused, not cast."""
    bad = [n for n in names if entries[n].dtype not in WEIGHT_DTYPES]
    if bad:
        e = entries[bad[0]]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(
            f"'{e.file}': tensor {bad[0]} is stored as {e.dtype}{more}, where a weight is a floating-point "
            f"number ({', '.join(WEIGHT_DTYPES)})",
            "give the folder transformers saved; ddpkit does not cast integers into weights",
        )
