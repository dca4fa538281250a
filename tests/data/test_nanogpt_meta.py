"""nanoGPT's data as it is: the files its data/shakespeare_char/prepare.py writes (uint16 train.bin / val.bin and a
pickled meta.pkl of {'vocab_size', 'itos', 'stoi'}) train under data.dataset=tokens and `ddpkit generate` decodes
the run with meta.pkl's characters, with no conversion; a meta.pkl that would run code, is huge or holds the
wrong types is one error line, and nothing runs or is written. In this process; budget: about 10 s."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from conftest import assert_user_error, cli_in_process, train_here
from ddpkit.data.text import nanogpt_meta, tokenizer
from ddpkit.errors import UserError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 12
TINY = [
    "model.arch=gpt", "data.dataset=tokens", "data.block_size=16", "model.n_layer=1", "model.n_head=2",
    "model.n_embd=16", "train.batch_size=8", "train.max_steps=2", "optim.name=adamw", "optim.lr=0.003",
    "optim.ref_batch_size=null", "report.curves=false",
]  # fmt: skip


def nanogpt_prepare(folder, data: str = TEXT) -> dict:
    """What nanoGPT's data/shakespeare_char/prepare.py does after reading input.txt, line for line."""
    chars = sorted(list(set(data)))
    vocab_size = len(chars)
    stoi = { ch:i for i,ch in enumerate(chars) }  # fmt: skip
    itos = { i:ch for i,ch in enumerate(chars) }  # fmt: skip

    def encode(s):
        return [stoi[c] for c in s]  # encoder: take a string, output a list of integers

    n = len(data)
    train_data = data[: int(n * 0.9)]
    val_data = data[int(n * 0.9) :]
    train_ids = encode(train_data)
    val_ids = encode(val_data)
    train_ids = np.array(train_ids, dtype=np.uint16)
    val_ids = np.array(val_ids, dtype=np.uint16)
    train_ids.tofile(os.path.join(folder, "train.bin"))
    val_ids.tofile(os.path.join(folder, "val.bin"))
    meta = {
        "vocab_size": vocab_size,
        "itos": itos,
        "stoi": stoi,
    }
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump(meta, f)
    return meta


def test_nanogpts_char_data_trains_and_generates_with_no_conversion(tmp_path, capsys):
    meta = nanogpt_prepare(tmp_path)
    run = tmp_path / "run"
    train_here(*TINY, f"data.root={tmp_path}", f"out_dir={run}")
    capsys.readouterr()  # the run's own lines
    tok = tokenizer.from_json((run / "tokenizer.json").read_text(), "the run's")
    assert tok.get_vocab().items() == meta["stoi"].items()  # nanoGPT's ids, character for character
    assert tokenizer.encode_prompt(tok, "All:") == [meta["stoi"][c] for c in "All:"]
    done = cli_in_process(capsys, "generate", str(run), "--prompt", "All:", "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    text = done.stdout.rstrip("\n")
    assert text.startswith("All:") and len(text) == 4 + 12 and set(text) <= set(meta["stoi"])


class Runs:
    def __reduce__(self):
        return (os.system, ("touch ran",))


@pytest.mark.parametrize(
    ("meta", "fragment"),
    [
        (Runs(), "asks to run posix.system"),
        (
            {"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"}, "stoi": {"a": 0}, "pad": "x" * (2 << 20)},
            "over 1 MiB",
        ),
        ([1, 2, 3], "holds a list, not a dict"),
        ({"vocab_size": 2, "itos": {0: "a"}}, "has no 'stoi'"),
        ({"vocab_size": "2", "itos": {}, "stoi": {}}, "its vocab_size is '2'"),
        ({"vocab_size": 2, "itos": ["a", "b"], "stoi": {"a": 0, "b": 1}}, "its itos and stoi are not dicts"),
        (
            {"vocab_size": 2, "itos": {0: "a", 2: "b"}, "stoi": {"a": 0, "b": 2}},
            "does not map the ids 0 .. 1",
        ),
        ({"vocab_size": 2, "itos": {0: "a", 1: "bc"}, "stoi": {"a": 0, "bc": 1}}, "'bc', not one character"),
        (
            {"vocab_size": 2, "itos": {0: "a", 1: "b"}, "stoi": {"a": 1, "b": 0}},
            "not the inverse of its itos",
        ),
        (b"\x80\x04\x95garbage", "is not nanoGPT's meta.pkl"),
    ],
)
def test_a_hostile_meta_pkl_is_refused_before_anything_runs(tmp_path, monkeypatch, meta, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta.pkl").write_bytes(meta if isinstance(meta, bytes) else pickle.dumps(meta))
    with pytest.raises(UserError, match=fragment):
        nanogpt_meta.read_meta(tmp_path)
    assert not (tmp_path / "ran").exists()  # the payload never ran


def test_a_bad_meta_pkl_or_a_vocab_size_against_it_is_one_line_and_writes_nothing(tmp_path, capsys):
    nanogpt_prepare(tmp_path)
    run = tmp_path / "run"
    wrong = cli_in_process(
        capsys, "train", *TINY, f"data.root={tmp_path}", f"out_dir={run}", "data.vocab_size=99"
    )
    assert_user_error(wrong, "data.vocab_size=99, but", "meta.pkl holds a vocabulary of 30 characters")
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(Runs()))
    hostile = cli_in_process(capsys, "train", *TINY, f"data.root={tmp_path}", f"out_dir={run}")
    assert_user_error(hostile, "asks to run posix.system", "data.tokenizer_file")
    assert not run.exists()
    # generate on a run of token files with no tokenizer says how to give one
    (tmp_path / "meta.pkl").unlink()
    train_here(*TINY, f"data.root={tmp_path}", f"out_dir={run}")
    capsys.readouterr()
    none = cli_in_process(capsys, "generate", str(run), "--prompt", "All:")
    assert_user_error(
        none, "has no tokenizer.json", "data.tokenizer_file=tokenizer.json", "nanoGPT's meta.pkl"
    )
