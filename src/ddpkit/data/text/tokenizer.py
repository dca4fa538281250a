"""The tokenizer of a language model's text: `data.tokenizer=char` (every distinct character one token) or `bpe`
(a byte-level BPE of data.vocab_size tokens trained on the training split with Hugging Face `tokenizers`, or read
from data.tokenizer_file). Both are held as one `tokenizers.Tokenizer` whose JSON text is saved as
out_dir/tokenizer.json; eval, resume and `ddpkit generate` read it back from there.

Training is deterministic (the same text and vocab_size give the same JSON) and done once: rank 0 trains, the
other ranks receive its JSON text. Its cost is bounded: data.vocab_size at most MAX_BPE_SIZE (and never more
than the corpus can give), lines cut into pieces of at most PIECE characters (a text of one huge line would
otherwise take time quadratic in its length). A tokenizer read from a file is hostile input: a regex of its
normalizer or pre-tokenizer that makes the regex engine give up (Rust panics in `tokenizers`) is one UserError,
and it is tried on a sample of the text before anything is written.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.config.bounded import loads_json
from ddpkit.errors import UserError, first_line

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

FILE = "tokenizer.json"  # in out_dir
DEFAULT_BPE_SIZE = 1024  # data.vocab_size left null with data.tokenizer=bpe
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte
MAX_BPE_SIZE = 1 << 20  # the largest BPE trained (tokenizers allocates about 70 bytes a token up front)
PIECE = 1024  # BPE training reads lines in pieces of at most this many characters
SAMPLE = 1 << 16  # characters of the text a tokenizer read from a file is tried on before anything is written
MAX_FILE_BYTES = 64 << 20  # the largest tokenizer.json read
FILE_HINT = "give a tokenizer.json written by Hugging Face tokenizers (or by ddpkit train)"


def char_tokenizer(vocab: list[str]) -> Tokenizer:
    """The character tokenizer of `vocab` (sorted distinct characters; token i is vocab[i]): a WordLevel model over
    single characters, decoded by joining them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(vocab)}))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    return tok


def train_bpe(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on `text` (deterministic; every string encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_pieces(text), trainer=trainer)
    return tok


def _pieces(text: str):
    """The lines of `text`, each cut into pieces of at most PIECE characters: BPE training's time grows with the
    square of a word's length, and a pre-tokenizer word is never longer than its piece."""
    for line in text.splitlines(keepends=True):
        for start in range(0, len(line), PIECE):
            yield line[start : start + PIECE]


def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException"  # pyo3's, a BaseException: tokenizers' Rust code panicked


@contextmanager
def rust_panics(where: str):
    """Run tokenizers code with the message a Rust panic prints kept off the terminal; a panic (the regex engine
    giving up on a normalizer's or pre-tokenizer's pattern) becomes one UserError naming `where`. Whatever else
    was printed meanwhile is passed on."""
    sys.stderr.flush()
    saved, held = os.dup(2), tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    panic = None
    try:
        yield
    except BaseException as e:
        if not _is_panic(e):
            raise
        panic = e
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        printed = held.read()
        held.close()
        if panic is None and printed:
            os.write(2, printed)
    if panic is not None:
        raise UserError(
            f"{where} fails on this text: {first_line(panic, limit=60)}",
            "a normalizer or pre-tokenizer regex backtracks without end: rewrite or remove it",
        ) from None


def try_on(tok: Tokenizer, text: str, where: str) -> None:
    """Encode and decode a sample of `text` with `tok` (quietly): UserError naming `where` when it panics."""
    with rust_panics(where):
        tok.decode(tok.encode(text[:SAMPLE], add_special_tokens=False).ids)


def from_json(text: str, where: str) -> Tokenizer:
    """A tokenizer from its JSON text; UserError naming `where` when it is not one."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for every malformed file
        raise UserError(
            f"{where} is not a tokenizer: {first_line(e, limit=60, joined=True)}", FILE_HINT
        ) from None
    if tok.get_vocab_size() == 0:
        raise UserError(f"{where} is a tokenizer with no tokens", FILE_HINT)
    return tok


def read_file(path: str | os.PathLike, what: str = "data.tokenizer_file") -> str:
    """The JSON text of tokenizer file `path` (bounded, UTF-8); UserError when it cannot be read."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise UserError(f"{what} '{path}' does not exist or is not a file", FILE_HINT)
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UserError(
            f"cannot read {what} '{path}': {e.strerror or e}", "check the file's permissions"
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{what} '{path}' is over {MAX_FILE_BYTES >> 20} MiB", FILE_HINT)

    try:
        text = raw.decode("utf-8")
        loads_json(text)
    except (UnicodeDecodeError, ValueError) as e:  # TooDeep is a ValueError
        raise UserError(
            f"{what} '{path}' is not JSON: {first_line(e, limit=60, joined=True)}", FILE_HINT
        ) from None
    return text


def encode(tok: Tokenizer, text: str, where: str = "the tokenizer") -> torch.Tensor:
    """The token ids of `text` (int32; int64 when the vocabulary needs it); UserError naming `where` on a panic."""
    import numpy as np
    import torch

    with rust_panics(where):
        ids = tok.encode(text, add_special_tokens=False).ids
    dtype = np.int32 if tok.get_vocab_size() < 2**31 else np.int64
    return torch.from_numpy(np.asarray(ids, dtype=dtype))


def encode_prompt(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids of a prompt; UserError when it is empty or holds characters the tokenizer has no token for."""
    if not prompt:
        raise UserError("--prompt is empty", "give the text to continue, e.g. --prompt 'def main'")
    try:
        with rust_panics("the run's tokenizer"):
            ids = tok.encode(prompt, add_special_tokens=False).ids
    except UserError:
        raise
    except Exception:  # a WordLevel model without an unknown token raises on a character it lacks
        vocab = tok.get_vocab()
        unknown = sorted({c for c in prompt if c not in vocab})
        shown = ", ".join(repr(c) for c in unknown[:5])
        raise UserError(
            f"the prompt holds characters this run's tokenizer has no token for: {shown}",
            "use only characters of the training text, or train with data.tokenizer=bpe (it encodes any text)",
        ) from None
    if not ids:
        raise UserError("the prompt encodes to no tokens", "give some text to continue")
    return ids


def vocab_size(cfg_vocab: int | None, text: str | None = None) -> int:
    """The BPE size to train: data.vocab_size, or the default; UserError below the byte alphabet or above
    MAX_BPE_SIZE. With the training `text`, no more than it can give (each merge needs a pair of its bytes)."""
    size = DEFAULT_BPE_SIZE if cfg_vocab is None else cfg_vocab
    if size < BYTE_ALPHABET:
        raise UserError(
            f"data.vocab_size={size} is too small for a byte-level BPE (it starts from {BYTE_ALPHABET} bytes)",
            f"set data.vocab_size to at least {BYTE_ALPHABET}",
        )
    if size > MAX_BPE_SIZE:
        raise UserError(
            f"data.vocab_size={size} is over the largest BPE ddpkit trains ({MAX_BPE_SIZE:,} tokens)",
            f"set data.vocab_size to at most {MAX_BPE_SIZE}, or give data.tokenizer_file",
        )
    if text is not None:  # the same tokenizer: the trainer stops when no pair is left to merge
        size = min(size, BYTE_ALPHABET + 4 * len(text))  # at most 4 bytes a character
    return size


def shared(make) -> str:
    """`make()`'s result (a tokenizer's JSON text) computed on rank 0 and sent to every rank."""
    from ddpkit.distributed.collectives import broadcast_object, is_main_process

    return broadcast_object(make() if is_main_process() else None)


def _named(cfg) -> str:
    """How to name this run's tokenizer: the file it came from, or the text it was made of."""
    if cfg.data.tokenizer_file:
        return f"data.tokenizer_file '{cfg.data.tokenizer_file}'"
    if cfg.data.dataset == "text" and cfg.data.tokenizer == "bpe":
        return f"'{Path(cfg.out_dir) / FILE}'"
    return "this run's characters"


def check_trained_with(cfg, now: str | None, trained: Any, checkpoint: str | os.PathLike) -> None:
    """UserError when a checkpoint (to continue or to score) was trained with another tokenizer than this run's:
    the checkpoint holds its own (`trained`, the JSON text); the ids would mean other text (a silently wrong
    run)."""
    if not isinstance(trained, str) or now is None or trained == now:
        return
    theirs, ours = (hashlib.sha256(t.encode("utf-8")).hexdigest()[:12] for t in (trained, now))
    raise UserError(
        f"{_named(cfg)} (sha256 {ours}) is not the tokenizer checkpoint '{checkpoint}' was trained with "
        f"(sha256 {theirs})",
        "give the run its own tokenizer and text, or train in another out_dir",
    )
