"""`data.dataset=tokens`: token ids already made, in nanoGPT's format: `data.root/train.bin` and `val.bin`, each a
flat array of unsigned integers (no header), read memory-mapped.

The integer type is data.token_dtype; `auto` is uint16 when data.vocab_size is unset or at most 65536 (what
nanoGPT's prepare scripts write), uint32 above. data.vocab_size bounds the ids (null: 1 + the largest id of the
two files). A sample is one block of `data.block_size + 1` ids: (x, y) = (block[:-1], block[1:]), both int64.
The data-parallel ranks shard the blocks as they shard `text`'s. data.tokenizer_file, when set, is the tokenizer
that made the files; else the `meta.pkl` nanoGPT's character-level prepare.py writes beside them, when there is
one (nanogpt_meta.py: read without unpickling code; its vocab_size is the vocabulary): saved as
out_dir/tokenizer.json for `ddpkit generate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.atomicio import NotRegularFile, check_regular
from ddpkit.cluster.machine import machine_memory
from ddpkit.data.entry import DatasetEntry, Splits
from ddpkit.data.text import TextBlocks, nanogpt_meta, tokenizer
from ddpkit.errors import UserError

if TYPE_CHECKING:
    import numpy as np

    from ddpkit.config import Config

SPLITS = (("train.bin", "training"), ("val.bin", "validation"))
LAYOUT = "data.root/train.bin and data.root/val.bin (token ids, uint16 or uint32)"
HINT = "write the files as nanoGPT does: np.array(ids, dtype=np.uint16).tofile('train.bin')"
CHUNK = 1 << 24  # ids scanned at once for the largest one
# an epoch's order of the blocks: an int64 permutation of all of them, and this rank's share as a Python list
ORDER_BYTES = 48


def dtype_name(cfg: Config) -> str:
    """uint16 or uint32: data.token_dtype, or for auto what data.vocab_size needs."""
    if cfg.data.token_dtype != "auto":
        return cfg.data.token_dtype
    return "uint16" if cfg.data.vocab_size is None or cfg.data.vocab_size <= 2**16 else "uint32"


def _open(cfg: Config, name: str, split: str) -> np.ndarray:
    """File `name` of data.root memory-mapped; UserError when missing, empty, of a size that is not whole ids, or
    shorter than one block."""
    import numpy as np

    path = Path(os.path.expanduser(cfg.data.root)) / name
    try:
        st = check_regular(path)
    except NotRegularFile as e:
        raise UserError(f"{path} is {e.strerror}, not a file of token ids", HINT) from None
    if st is None:
        raise UserError(f"data.dataset=tokens needs {path}, which does not exist", HINT)
    dtype = np.dtype(dtype_name(cfg))
    size = st.st_size
    if size == 0:
        raise UserError(f"{path} is empty", HINT)
    if size % dtype.itemsize:
        raise UserError(
            f"{path} is {size} bytes, not a whole number of {dtype.name} ids ({dtype.itemsize} bytes each)",
            "the file is cut short, or set data.token_dtype to the type it was written with",
        )
    block = cfg.data.block_size
    _check_order_fits(path, size // dtype.itemsize, block)
    ids = np.memmap(path, dtype=dtype, mode="r")
    if len(ids) < block + 1:
        raise UserError(
            f"{path} holds {len(ids)} ids, too few for one {split} block of data.block_size={block}",
            "write more tokens or lower data.block_size",
        )
    return ids


def _check_order_fits(path: Path, ids: int, block: int) -> None:
    """UserError when an epoch's order of the file's blocks (ORDER_BYTES a block, in every process) would not fit
    in half this machine's memory: checked from the size alone, before a single id is read (a sparse file of
    100 GB would take minutes to scan, then fail to allocate)."""
    blocks = ids // block
    need, have = blocks * ORDER_BYTES, machine_memory()
    if need > have // 2:
        raise UserError(
            f"{path} holds {ids:,} ids: an epoch's order of its {blocks:,} blocks needs {need / 2**30:.0f} GiB a "
            f"process, over half this machine's {have / 2**30:.0f} GiB",
            "give a shorter file or a larger data.block_size",
        )


def _largest(ids: np.ndarray) -> int:
    return max(int(ids[i : i + CHUNK].max()) for i in range(0, len(ids), CHUNK))


def _vocab_size(cfg: Config, arrays: list[tuple[np.ndarray, str]], meta: int | None = None) -> int:
    """data.vocab_size (or the size of the vocabulary in meta.pkl), checked against every id, or 1 + the largest
    id; UserError on an id out of range."""
    want, named = cfg.data.vocab_size, f"data.vocab_size={cfg.data.vocab_size}"
    if meta is not None:
        if want is not None and want != meta:
            raise UserError(
                f"{named}, but {Path(cfg.data.root) / nanogpt_meta.FILE} holds a vocabulary of {meta} characters",
                "leave data.vocab_size unset: it comes from meta.pkl",
            )
        want, named = meta, f"the vocab_size {meta} of {nanogpt_meta.FILE}"
    largest = {name: _largest(ids) for ids, name in arrays}
    if want is None:
        return 1 + max(largest.values())
    for name, top in largest.items():
        if top >= want:
            raise UserError(
                f"{Path(cfg.data.root) / name} holds token id {top}, not below {named}",
                "set data.vocab_size to the tokenizer's size, or data.token_dtype to the files' type",
            )
    return want


def _meta(cfg: Config) -> tuple[str, int] | None:
    """(tokenizer JSON, vocabulary size) of nanoGPT's meta.pkl beside the files, unless data.tokenizer_file
    names the tokenizer."""
    return None if cfg.data.tokenizer_file else nanogpt_meta.meta_tokenizer(cfg.data.root)


def _files(cfg: Config, meta: tuple[str, int] | None = None) -> tuple[list[tuple[np.ndarray, str]], int]:
    arrays = [(_open(cfg, name, split), name) for name, split in SPLITS]
    return arrays, _vocab_size(cfg, arrays, meta[1] if meta else None)


def _check(cfg: Config) -> None:
    if cfg.data.tokenizer != "char":
        raise UserError(
            f"data.tokenizer={cfg.data.tokenizer} trains a tokenizer; data.dataset=tokens is tokenized already",
            "leave data.tokenizer unset; give the files' tokenizer as data.tokenizer_file (for generate)",
        )
    root = Path(os.path.expanduser(cfg.data.root))
    if not root.is_dir():
        raise UserError(f"data.root '{cfg.data.root}' is not a folder", f"data.dataset=tokens reads {LAYOUT}")
    _files(cfg, _meta(cfg))
    if cfg.data.tokenizer_file:
        tokenizer.from_json(tokenizer.read_file(cfg.data.tokenizer_file), "data.tokenizer_file")


def _build(cfg: Config) -> Splits:
    meta = _meta(cfg)
    arrays, vocab = _files(cfg, meta)
    (train, _), (val, _) = arrays
    block = cfg.data.block_size
    tok = tokenizer.read_file(cfg.data.tokenizer_file) if cfg.data.tokenizer_file else None
    tok = meta[0] if meta else tok
    # the blocks read int64 slices of the maps (torch has no arithmetic on uint16/uint32 tensors)
    return Splits(
        TextBlocks(_Ids(train), block),
        TextBlocks(_Ids(val), block),
        num_classes=vocab,
        in_channels=0,
        image_size=0,
        vocab_size=vocab,
        tokenizer=tok,
    )


class _Ids:
    """A memory-mapped id array read as int64 tensors slice by slice (the file is never loaded whole)."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, s: slice):
        import numpy as np
        import torch

        return torch.from_numpy(np.asarray(self.ids[s], dtype=np.int64))


TOKENS = DatasetEntry("tokens", _build, label="tokens", layout=LAYOUT, check=_check, tokens=True)
ENTRIES = (TOKENS,)  # registered by data/registry.py
