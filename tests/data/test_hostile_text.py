"""A language model's inputs as hostile input: a BPE size that would exhaust memory, a tokenizer.json whose regex
makes the regex engine give up, a corpus of one huge line, token files that are not files or are too large for
this machine. Each is one UserError before anything is written; in this process on a few kilobytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import cli_env
from ddpkit import data
from ddpkit.config import load_config
from ddpkit.data.text import tokenizer
from ddpkit.errors import UserError

CORPUS = "def main(argv):\n    return sorted(set(argv)) or None\n" * 40
BACKTRACKS = "(a|aa)+$"  # with "a" * 3000 + "x" in the text: Onig's retry limit, a Rust panic in tokenizers


def text_cfg(tmp_path, text: str, *overrides: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    return load_config(
        None,
        [
            f"out_dir={tmp_path / 'run'}",
            "data.block_size=8",
            "data.dataset=text",
            f"data.root={corpus}",
            *overrides,
        ],
    )


@pytest.mark.parametrize("size", ["1000000000", str(2**32)])
def test_a_bpe_size_over_the_stated_maximum_is_one_line(tmp_path, size):
    # before: the tokenizers library aborted the process allocating 70 GB
    with pytest.raises(UserError, match=f"data.vocab_size={size} is over the largest BPE ddpkit trains"):
        data.check_available(text_cfg(tmp_path, CORPUS, "data.tokenizer=bpe", f"data.vocab_size={size}"))
    # at the maximum, a small corpus trains what it can give and allocates for no more
    assert tokenizer.vocab_size(tokenizer.MAX_BPE_SIZE, "ab" * 10) == 256 + 80
    _, _, spec = data.build_datasets(
        text_cfg(tmp_path, CORPUS, "data.tokenizer=bpe", f"data.vocab_size={tokenizer.MAX_BPE_SIZE}")
    )
    assert 256 < spec.vocab_size < 400


def evil_tokenizer(path, where: str) -> None:
    """A BPE trained on CORPUS whose normalizer or pre-tokenizer holds a regex that backtracks without end."""
    spec = json.loads(tokenizer.train_bpe(CORPUS, 300).to_str())
    if where == "normalizer":
        spec["normalizer"] = {"type": "Replace", "pattern": {"Regex": BACKTRACKS}, "content": "b"}
    else:
        spec["pre_tokenizer"] = {
            "type": "Split",
            "pattern": {"Regex": BACKTRACKS},
            "behavior": "Isolated",
            "invert": False,
        }
    path.write_text(json.dumps(spec))


@pytest.mark.parametrize("where", ["normalizer", "pre_tokenizer"])
def test_a_tokenizer_file_whose_regex_backtracks_without_end_is_one_line(tmp_path, capfd, where):
    evil_tokenizer(tmp_path / "tok.json", where)
    bad = CORPUS + "a" * 3000 + "x\n" + CORPUS
    cfg = text_cfg(tmp_path, bad, "data.tokenizer=bpe", f"data.tokenizer_file={tmp_path / 'tok.json'}")
    with pytest.raises(UserError, match="fails on this text: .*retry-limit-in-match over.*backtracks"):
        data.check_available(cfg)  # tried on a sample of the text before anything is written
    # beyond the sample: the same line when the whole text is encoded
    late = CORPUS * 40 + "a" * 3000 + "x\n" + CORPUS
    assert len(late) > tokenizer.SAMPLE
    cfg = text_cfg(tmp_path, late, "data.tokenizer=bpe", f"data.tokenizer_file={tmp_path / 'tok.json'}")
    data.check_available(cfg)
    with pytest.raises(UserError, match="fails on this text"):
        data.build_datasets(cfg)
    assert "panicked" not in capfd.readouterr().err  # Rust's panic message is kept off the terminal
    print("kept", file=sys.stderr)  # what is printed outside a panic still shows
    assert capfd.readouterr().err == "kept\n"


ONE_LINE = """import sys, numpy as np
from ddpkit.data.text.tokenizer import train_bpe
text = "".join(np.random.default_rng(0).choice(list("abcdefghij"), 1_000_000))
print(train_bpe(text, 1024).get_vocab_size())
"""


def test_bpe_training_on_one_huge_line_is_bounded(tmp_path):
    # before: time quadratic in the line's length (100,000 characters 8 s; this one, a million, about 13 minutes)
    proc = subprocess.run(
        [sys.executable, "-c", ONE_LINE], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "1024", proc.stderr[-2000:]


def write_bins(root, n: int = 200) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("train.bin", "val.bin"):
        np.asarray(np.arange(n) % 50, dtype=np.uint16).tofile(root / name)


def test_token_files_that_are_not_files_are_named_as_what_they_are(tmp_path):
    root = tmp_path / "bins"
    write_bins(root)
    train = root / "train.bin"
    cases = [
        (lambda: os.mkfifo(train), "is a FIFO"),
        (lambda: train.mkdir(), "is a folder"),
        (lambda: train.symlink_to(train), "is a symlink loop"),
        (lambda: train.symlink_to("/dev/zero"), "is a character device"),
    ]
    for make, kind in cases:
        if train.is_dir() and not train.is_symlink():
            train.rmdir()
        else:
            train.unlink(missing_ok=True)
        make()
        cfg = load_config(None, [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={root}"])
        with pytest.raises(UserError, match=f"train.bin {kind}, not a file of token ids"):
            data.check_available(cfg)  # before: "needs train.bin, which does not exist"


def test_a_sparse_100_gb_token_file_is_one_line_before_it_is_read(tmp_path):
    root = tmp_path / "bins"
    write_bins(root)
    os.truncate(root / "train.bin", 100 << 30)  # sparse: no disk used
    cfg = load_config(
        None, [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={root}", "data.block_size=2"]
    )
    # before: two minutes of reading zeros, then a traceback from torch.randperm's allocation
    with pytest.raises(
        UserError, match=r"train.bin holds 53,687,091,200 ids: an epoch's order .* GiB a process, over half"
    ):
        data.check_available(cfg)
