"""nanoGPT's `meta.pkl`: the character vocabulary its data/shakespeare_char/prepare.py writes beside train.bin and
val.bin, `pickle.dump({'vocab_size': len(chars), 'itos': {i: ch}, 'stoi': {ch: i}}, f)`, read as the character
tokenizer of `data.dataset=tokens` (so `ddpkit generate` can decode a run trained on those files).

A meta.pkl is someone else's file: it is read without unpickling code (data/safe_pickle.py with no global
allowed: only dicts, numbers and strings are built), at most MAX_BYTES, and checked before it is used: itos maps
0 .. vocab_size-1 each to one character, stoi is its inverse, vocab_size is their size. Anything else is one
UserError naming the file and what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpkit.atomicio import NotRegularFile, open_regular
from ddpkit.data import safe_pickle
from ddpkit.data.text.tokenizer import char_tokenizer
from ddpkit.errors import UserError, first_line

FILE = "meta.pkl"  # beside train.bin, as nanoGPT writes it
MAX_BYTES = 1 << 20  # a character vocabulary pickles to a few KiB
MAX_VOCAB = 1 << 16  # nanoGPT writes uint16 ids
HINT = "give nanoGPT's own meta.pkl, or remove it and give data.tokenizer_file a tokenizer.json"


def _read(path: Path) -> bytes:
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except NotRegularFile as e:
        raise UserError(f"{path} is {e.strerror}, not nanoGPT's meta.pkl", HINT) from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}", "check the file's permissions") from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path} is over {MAX_BYTES >> 20} MiB, far more than a character vocabulary", HINT)
    return raw


def _unpickled(path: Path, raw: bytes) -> Any:
    try:
        return safe_pickle.loads(raw, allowed=frozenset())
    except Exception as e:  # a hostile pickle fails in many ways (truncated, bad opcodes, refused globals)
        raise UserError(f"{path} is not nanoGPT's meta.pkl: {first_line(e, limit=56)}", HINT) from None


def _vocab(meta: Any) -> list[str]:
    """The characters of token 0, 1, ...; ValueError saying what is wrong."""
    if not isinstance(meta, dict):
        raise ValueError(f"it holds a {type(meta).__name__}, not a dict")
    missing = [k for k in ("vocab_size", "itos", "stoi") if k not in meta]
    if missing:
        raise ValueError(f"it has no {missing[0]!r}")
    size, itos, stoi = meta["vocab_size"], meta["itos"], meta["stoi"]
    if type(size) is not int or not 0 < size <= MAX_VOCAB:
        raise ValueError(f"its vocab_size is {size!r}, not a number of tokens from 1 to {MAX_VOCAB}")
    if not isinstance(itos, dict) or not isinstance(stoi, dict):
        raise ValueError("its itos and stoi are not dicts")
    if len(itos) != size or sorted(k for k in itos if type(k) is int) != list(range(size)):
        raise ValueError(f"its itos does not map the ids 0 .. {size - 1} (vocab_size), once each")
    chars = [itos[i] for i in range(size)]
    odd = next((c for c in chars if not isinstance(c, str) or len(c) != 1), None)
    if odd is not None or len(set(chars)) != size:
        what = f"{odd!r}, not one character" if odd is not None else "a character twice"
        raise ValueError(f"its itos maps an id to {what}")
    if stoi != {c: i for i, c in enumerate(chars)}:
        raise ValueError("its stoi is not the inverse of its itos")
    return chars


def read_meta(root: str | os.PathLike) -> list[str] | None:
    """The characters of token 0, 1, ... from `root`/meta.pkl, or None when there is none; UserError when it is not
    nanoGPT's character vocabulary (see the module)."""
    path = Path(os.path.expanduser(str(root))) / FILE
    if not path.exists() and not path.is_symlink():
        return None
    meta = _unpickled(path, _read(path))
    try:
        return _vocab(meta)
    except ValueError as e:
        raise UserError(f"{path} is not nanoGPT's character vocabulary: {e}", HINT) from None


def meta_tokenizer(root: str | os.PathLike) -> tuple[str, int] | None:
    """(the tokenizer's JSON text, its vocabulary size) made from `root`/meta.pkl, or None when there is none."""
    chars = read_meta(root)
    if chars is None:
        return None
    return char_tokenizer(chars).to_str(), len(chars)


__all__ = ["FILE", "meta_tokenizer", "read_meta"]
