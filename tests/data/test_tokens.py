"""Tokenizers (data.tokenizer=char|bpe, data.tokenizer_file) and token files (data.dataset=tokens): in this process
on a few kilobytes; the 2-process run with a BPE is in tests/commands/test_generate.py. Budget: about 10 s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpkit import data
from ddpkit.config import load_config
from ddpkit.data.text import tokenizer
from ddpkit.errors import UserError

CORPUS = "def main(argv):\n    return sorted(set(argv)) or None  # héllo\n" * 60


def cfg_of(tmp_path, *overrides: str):
    return load_config(None, [f"out_dir={tmp_path / 'run'}", "data.block_size=8", *overrides])


def text_cfg(tmp_path, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    return cfg_of(tmp_path, "data.dataset=text", f"data.root={corpus}", *overrides)


def test_bpe_is_trained_on_the_training_split_deterministically_and_round_trips(tmp_path):
    cfg = text_cfg(tmp_path, "data.tokenizer=bpe", "data.vocab_size=300")
    train, val, spec = data.build_datasets(cfg)
    again = data.build_datasets(cfg)[2]
    assert spec.tokenizer == again.tokenizer  # the same JSON text each time
    tok = tokenizer.from_json(spec.tokenizer, "the run's")
    assert 256 < spec.vocab_size == tok.get_vocab_size() <= 300  # at most: this text has fewer pairs to merge
    cut = len(CORPUS) - int(len(CORPUS) * 0.1)
    assert tok.decode(tokenizer.encode(tok, CORPUS[:cut]).tolist()) == CORPUS[:cut]
    assert len(tokenizer.encode(tok, CORPUS[:cut])) < cut / 2  # merges learnt: fewer tokens than characters
    x, y = train[0]
    assert x.dtype == torch.int64 and torch.equal(x[1:], y[:-1]) and int(x.max()) < 300
    assert tok.decode(tokenizer.encode(tok, "any text ☃ at all").tolist()) == "any text ☃ at all"
    # a tokenizer file is used as it is; so is the run's own on a resume
    path = tmp_path / "tok.json"
    path.write_text(spec.tokenizer)
    given = data.build_datasets(text_cfg(tmp_path, "data.tokenizer=bpe", f"data.tokenizer_file={path}"))[2]
    assert given.tokenizer == spec.tokenizer
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "tokenizer.json").write_text(spec.tokenizer)
    fresh = data.build_datasets(text_cfg(tmp_path, "data.tokenizer=bpe", "data.vocab_size=280"))[2]
    assert fresh.tokenizer != spec.tokenizer  # no checkpoint to continue: trained anew
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"")
    resumed = data.build_datasets(text_cfg(tmp_path, "data.tokenizer=bpe", "data.vocab_size=280"))[2]
    assert resumed.tokenizer == spec.tokenizer


def test_the_char_tokenizer_is_saved_as_the_same_vocabulary(tmp_path):
    _, _, spec = data.build_datasets(text_cfg(tmp_path))
    tok = tokenizer.from_json(spec.tokenizer, "the run's")
    vocab = sorted(set(CORPUS))
    assert tok.get_vocab_size() == spec.vocab_size == len(vocab)
    assert tokenizer.encode_prompt(tok, "main") == [vocab.index(c) for c in "main"]
    assert tok.decode(tokenizer.encode_prompt(tok, "set(argv)\n")) == "set(argv)\n"
    with pytest.raises(UserError, match="no token for: 'Z'"):
        tokenizer.encode_prompt(tok, "Zmain")
    with pytest.raises(UserError, match="--prompt is empty"):
        tokenizer.encode_prompt(tok, "")


@pytest.mark.parametrize(
    ("overrides", "content", "fragment"),
    [
        (["data.tokenizer=bpe", "data.vocab_size=100"], None, "too small for a byte-level BPE"),
        (["data.tokenizer=bpe", "data.tokenizer_file=TOK"], b"{not json", "is not JSON"),
        (["data.tokenizer=bpe", "data.tokenizer_file=TOK"], b'{"model": 3}', "is not a tokenizer"),
        (["data.tokenizer=bpe", "data.tokenizer_file=TOK"], None, "does not exist"),
        (["data.tokenizer_file=TOK"], b"{}", "add data.tokenizer=bpe"),
    ],
)
def test_a_bad_tokenizer_setting_is_one_error_line(tmp_path, overrides, content, fragment):
    tok = tmp_path / "tok.json"
    if content is not None:
        tok.write_bytes(content)
    cfg = text_cfg(tmp_path, *(o.replace("TOK", str(tok)) for o in overrides))
    with pytest.raises(UserError, match=fragment):
        data.check_available(cfg)


# ---------------------------------------------------------------------------------------------------------------
# data.dataset=tokens


def write_bins(root, train, val, dtype=np.uint16):
    root.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=dtype).tofile(root / "train.bin")
    np.asarray(val, dtype=dtype).tofile(root / "val.bin")


def test_token_files_are_memory_mapped_blocks_of_their_ids(tmp_path):
    root = tmp_path / "bins"
    write_bins(root, np.arange(200) % 50, np.arange(40) % 50)
    train, val, spec = data.build_datasets(cfg_of(tmp_path, "data.dataset=tokens", f"data.root={root}"))
    assert spec.vocab_size == 50 and spec.tokenizer is None  # 1 + the largest id
    assert len(train) == 199 // 8 and len(val) == 39 // 8
    x, y = train[2]
    assert x.dtype == torch.int64 and x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    write_bins(root, np.arange(100) + 70000, np.arange(20) + 70000, np.uint32)
    big = cfg_of(tmp_path, "data.dataset=tokens", f"data.root={root}", "data.vocab_size=70200")
    train, _, spec = data.build_datasets(big)  # uint32 inferred from the vocabulary's size
    assert spec.vocab_size == 70200 and train[0][0][0].item() == 70000


@pytest.mark.parametrize(
    ("train", "raw", "overrides", "fragment"),
    [
        (np.arange(100), None, ["data.vocab_size=64"], "holds token id 99, not below data.vocab_size=64"),
        (None, b"\x01\x00\x02", [], "not a whole number of uint16 ids"),
        (None, b"", [], "is empty"),
        (np.arange(5), None, [], "too few for one training block"),
        (np.arange(9), None, ["data.token_dtype=uint32"], "not a whole number of uint32 ids"),
    ],
)
def test_bad_token_files_are_one_error_line(tmp_path, train, raw, overrides, fragment):
    root = tmp_path / "bins"
    write_bins(root, np.arange(100) if train is None else train, np.arange(30))
    if raw is not None:
        (root / "train.bin").write_bytes(raw)
    with pytest.raises(UserError, match=fragment):
        data.check_available(cfg_of(tmp_path, "data.dataset=tokens", f"data.root={root}", *overrides))
    with pytest.raises(UserError, match="does not exist"):
        data.check_available(cfg_of(tmp_path, "data.dataset=tokens", f"data.root={tmp_path}"))
    with pytest.raises(UserError, match="data.dataset=tokens is tokenized already"):
        data.check_available(
            cfg_of(tmp_path, "data.dataset=tokens", f"data.root={root}", "data.tokenizer=bpe")
        )
