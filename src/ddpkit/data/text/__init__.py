"""`data.dataset=text`: text for the built-in language models, with no download.

The source is `data.root` (a text file, or a folder whose files are read in sorted order), or, with data.root
left at its default, the `.py` files at the top of the running Python's standard library (sorted by name, the
same text on every run of one Python). At most `data.text_bytes` bytes are read. The last tenth of the text is
the validation split. data.tokenizer=char (the default): the vocabulary is the sorted set of characters of the
text; bpe: a byte-level BPE trained on the training split (or data.tokenizer_file; on a resume the run's own
out_dir/tokenizer.json), see tokenizer.py. A sample is one block of `data.block_size + 1` tokens:
(x, y) = (block[:-1], block[1:]), both int64 token ids of length block_size.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.atomicio import NotRegularFile, kind_of, open_regular
from ddpkit.data.entry import DatasetEntry, Splits
from ddpkit.data.text import tokenizer
from ddpkit.errors import UserError

if TYPE_CHECKING:
    import torch

    from ddpkit.config import Config

VAL_FRACTION = 0.1
DEFAULT_ROOT = "data"  # data.root's schema default: for text it means "the standard library's sources"
ROOT_HINT = "give data.root a UTF-8 text file or a folder of them, or leave it unset for Python's own sources"


def stdlib_files() -> list[Path]:
    """The `.py` files at the top of the running Python's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def source_files(cfg: Config) -> tuple[list[Path], str]:
    """(the files to read, in order; how to name the source in messages); UserError when there are none."""
    root = cfg.data.root
    if root == DEFAULT_ROOT and not os.path.exists(root):
        files = stdlib_files()
        if not files:
            raise UserError("this Python has no standard-library .py files to read", ROOT_HINT)
        return files, "the standard library's sources"
    path = Path(os.path.expanduser(root))
    if not path.exists():
        raise UserError(f"data.root '{root}' does not exist", ROOT_HINT)
    if path.is_file():
        return [path], f"data.root '{root}'"
    if not path.is_dir():
        raise UserError(
            f"data.root '{root}' is {kind_of(path.stat().st_mode)}, not a file or a folder", ROOT_HINT
        )
    files = sorted(
        p
        for p in path.rglob("*")
        if not p.is_dir() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise UserError(f"data.root '{root}' holds no files", ROOT_HINT)
    return files, f"data.root '{root}'"


def _read_one(path: Path, budget: int) -> str:
    """At most `budget` bytes of `path` as text; UserError for a binary or non-UTF-8 file."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:  # a FIFO or device would block a plain open
            raw = fh.read(budget)
    except NotRegularFile as e:
        raise UserError(f"'{path}' is {e.strerror}, not a text file", ROOT_HINT) from None
    except OSError as e:
        raise UserError(f"cannot read '{path}': {e.strerror or e}", "check the file's permissions") from None
    if b"\x00" in raw:
        raise UserError(f"'{path}' is a binary file, not text", ROOT_HINT)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(raw) - 3:  # the byte budget cut a multi-byte character: drop its first bytes
            return raw[: e.start].decode("utf-8")
        raise UserError(f"'{path}' is not UTF-8 text (byte {e.start})", ROOT_HINT) from None


def read_text(cfg: Config) -> str:
    """The text of the source, at most data.text_bytes bytes; UserError when it is too short to make samples."""
    files, where = source_files(cfg)
    budget, parts = cfg.data.text_bytes, []
    for path in files:
        if budget <= 0:
            break
        part = _read_one(path, budget)
        parts.append(part)
        budget -= len(part.encode("utf-8"))
    text = "".join(parts)
    need = min_chars(cfg.data.block_size)
    if not text:
        raise UserError(f"{where} holds no text", ROOT_HINT)
    if len(text) < need:
        raise UserError(
            f"{where} holds {len(text)} characters, too few for data.block_size={cfg.data.block_size}",
            f"give at least {need} characters of text or lower data.block_size",
        )
    return text


def min_chars(block_size: int) -> int:
    """The shortest text that gives one validation block (and so some training blocks)."""
    return int((block_size + 1) / VAL_FRACTION) + 1


class TextBlocks:
    """Non-overlapping blocks of a token-id sequence: sample i = (ids[i*B : i*B+B], ids[i*B+1 : i*B+B+1])."""

    in_memory = True  # nothing to decode: the loaders need no corrupt-sample checks

    def __init__(self, ids: torch.Tensor, block_size: int):
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        chunk = self.ids[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    """(token ids of `text`, the vocabulary: its sorted distinct characters)."""
    import numpy as np
    import torch

    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    chars, ids = np.unique(codes, return_inverse=True)
    return torch.from_numpy(ids.astype(np.int32)), [chr(c) for c in chars]


def _check(cfg: Config) -> None:
    # bounded by data.text_bytes: a binary, empty or short source fails before any worker starts
    text = read_text(cfg)
    if cfg.data.tokenizer_file and cfg.data.tokenizer != "bpe":
        raise UserError(
            "data.tokenizer_file is set but data.tokenizer=char trains no tokenizer", "add data.tokenizer=bpe"
        )
    if cfg.data.tokenizer == "bpe":
        tokenizer.vocab_size(cfg.data.vocab_size)
        found = _given_tokenizer(cfg)
        if found is not None:  # a file is hostile input: tried on the text before anything is written
            json_text, where = found
            tokenizer.try_on(tokenizer.from_json(json_text, where), text, where)


def _build(cfg: Config) -> Splits:
    text, block = read_text(cfg), cfg.data.block_size
    if cfg.data.tokenizer == "bpe":
        return _build_bpe(cfg, text)
    ids, vocab = encode(text)
    cut = len(ids) - int(len(ids) * VAL_FRACTION)
    train, val = TextBlocks(ids[:cut], block), TextBlocks(ids[cut:], block)
    tok = tokenizer.char_tokenizer(vocab).to_str()
    return Splits(
        train, val, num_classes=len(vocab), in_channels=0, image_size=0, vocab_size=len(vocab), tokenizer=tok
    )


def run_tokenizer(cfg: Config) -> str | None:
    """The JSON text of out_dir/tokenizer.json when this run continues an earlier one in out_dir (resume on, and
    a checkpoint there to continue from), else None."""
    from ddpkit.checkpoint import CheckpointDir

    path = Path(cfg.out_dir) / tokenizer.FILE
    continues = cfg.checkpoint.resume != "none" and not cfg.checkpoint.overwrite
    if not (continues and path.is_file() and CheckpointDir(cfg.out_dir).candidates()):
        return None
    return tokenizer.read_file(path, "out_dir's tokenizer")


def _given_tokenizer(cfg: Config) -> tuple[str, str] | None:
    """(JSON text, how to name it) of the BPE not trained here: data.tokenizer_file, or the run's own
    out_dir/tokenizer.json when this run continues one; None when one is to be trained."""
    if cfg.data.tokenizer_file:
        return tokenizer.read_file(
            cfg.data.tokenizer_file
        ), f"data.tokenizer_file '{cfg.data.tokenizer_file}'"
    own = run_tokenizer(cfg)
    return None if own is None else (own, f"'{Path(cfg.out_dir) / tokenizer.FILE}'")


def _build_bpe(cfg: Config, text: str) -> Splits:
    """The BPE of data.tokenizer_file, of the run being continued, or trained on the training split (rank 0,
    then sent to every rank); both splits encoded with it."""
    cut = len(text) - int(len(text) * VAL_FRACTION)
    found = _given_tokenizer(cfg)
    if found is None:
        size = tokenizer.vocab_size(cfg.data.vocab_size, text[:cut])
        json_text = tokenizer.shared(lambda: tokenizer.train_bpe(text[:cut], size).to_str())
        where = "the trained tokenizer"
    else:
        json_text, where = found
    tok = tokenizer.from_json(json_text, where)
    train_ids, val_ids = tokenizer.encode(tok, text[:cut], where), tokenizer.encode(tok, text[cut:], where)
    block = cfg.data.block_size
    for ids, split in ((train_ids, "training"), (val_ids, "validation")):
        if len(ids) < block + 1:
            raise UserError(
                f"the {split} split is {len(ids)} tokens, too few for data.block_size={block}",
                "give more text (data.text_bytes, data.root) or lower data.block_size",
            )
    n = tok.get_vocab_size()
    return Splits(
        TextBlocks(train_ids, block),
        TextBlocks(val_ids, block),
        num_classes=n,
        in_channels=0,
        image_size=0,
        vocab_size=n,
        tokenizer=json_text,
    )


TEXT = DatasetEntry(
    "text", _build, label="text", layout="a UTF-8 text file or a folder of them", check=_check, tokens=True
)
ENTRIES = (TEXT,)  # registered by data/registry.py
