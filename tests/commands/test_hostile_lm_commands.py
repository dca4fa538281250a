"""`ddpkit generate`, `export`, `eval` and a resume given hostile input: flags out of their stated ranges, a FIFO
or a damaged shard for a checkpoint, a run whose tokenizer was replaced, a checkpoint that would run code. Each is
one `ddpkit: error:` line. One tiny BPE run (one step, sharded checkpoints) made in this process serves them all.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings

import pytest

from conftest import assert_user_error, cli_in_process, train_here
from ddpkit.data.text import tokenizer

CORPUS = "def main(argv):\n    return sorted(set(argv)) or None  # hello\n" * 60


def run_args(out, corpus) -> list[str]:
    return [
        f"out_dir={out}",
        "model.arch=gpt",
        "data.dataset=text",
        f"data.root={corpus}",
        "data.tokenizer=bpe",
        "data.vocab_size=300",
        "data.block_size=8",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=16",
        "train.max_steps=1",
        "checkpoint.format=sharded",
        "report.curves=false",
    ]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """(the run directory, its corpus): one optimizer step of a tiny GPT on a BPE."""
    base = tmp_path_factory.mktemp("hostile_lm")
    (base / "corpus.txt").write_text(CORPUS)
    train_here(*run_args(base / "run", base / "corpus.txt"))
    return base / "run", base / "corpus.txt"


def copy_of(lm_run, tmp_path):
    run, corpus = lm_run
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", corpus


def test_generate_flags_out_of_their_ranges_are_one_line_each(lm_run, capsys):
    run, _ = lm_run
    cases = [
        (["--temperature", "1e-300"], "--temperature: must be 0 (greedy) or from 0.001 to 100, not 1e-300"),
        (["--temperature", "1e300"], "--temperature: must be 0 (greedy) or from 0.001 to 100"),
        (["--seed", str(10**30)], "--seed: must be an integer from 0 to 9223372036854775807"),
        (["--seed", "-1"], "--seed: must be an integer from 0 to"),
        (["--seed", "9" * 5000], "not 9999999999999999999999999999999999999999 ..."),
        (["--top-k", "0"], "--top-k: must be an integer >= 1"),
        (["--top-k", "100000"], "--top-k 100000 is over this model's vocabulary of 293 tokens"),
        (["--max-new-tokens", str(10**9)], "is over 16 times this model's context of 8 tokens (128)"),
    ]
    for flags, fragment in cases:
        assert_user_error(cli_in_process(capsys, "generate", str(run), "--prompt", "def", *flags), fragment)
    out = cli_in_process(capsys, "generate", str(run), "--prompt", "def", "--max-new-tokens", "128")
    assert out.returncode == 0 and out.stdout.startswith("def"), out.stderr  # the largest allowed runs


def test_a_fifo_or_a_device_given_as_the_checkpoint_is_named(tmp_path, capsys):
    os.mkfifo(tmp_path / "ckpt.pt")
    for path, kind in ((tmp_path / "ckpt.pt", "a FIFO"), ("/dev/zero", "a character device")):
        for argv in (
            ["generate", str(path), "--prompt", "x"],
            ["export", str(path), "--to", "hf", str(tmp_path / "out")],
            ["eval", f"checkpoint.path={path}"],
        ):
            assert_user_error(
                cli_in_process(capsys, *argv), f"checkpoint '{path}' is {kind}, not a checkpoint"
            )


def test_export_of_a_sharded_checkpoint_with_a_zero_filled_shard_names_the_shard(lm_run, tmp_path, capsys):
    run, _ = copy_of(lm_run, tmp_path)
    for shard in (run / "checkpoints").glob("*.dcp/*.distcp"):  # the run's best and last
        shard.write_bytes(b"\0" * shard.stat().st_size)
    for argv in (
        ["export", str(run), "--to", "hf", str(tmp_path / "hf")],
        ["generate", str(run), "--prompt", "x"],
    ):
        assert_user_error(
            cli_in_process(capsys, *argv),
            f"its shard {shard.name} of",
            "is damaged: it is not a torch.save file",
        )
    assert not (tmp_path / "hf").exists()


def test_a_resume_or_eval_with_another_tokenizer_is_refused(lm_run, tmp_path, capsys):
    run, corpus = copy_of(lm_run, tmp_path)
    ours = (run / "tokenizer.json").read_text()
    other = tokenizer.train_bpe("import os\nprint(os.getcwd(), 'other text')\n" * 50, 300).to_str()
    assert (
        other != ours
        and json.loads(other)["model"]["vocab"].keys() != json.loads(ours)["model"]["vocab"].keys()
    )
    (run / "tokenizer.json").write_text(other)  # the same kind of file, another tokenizer
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = cli_in_process(capsys, "train", *run_args(run, corpus)[:-3], "train.max_steps=2")
    assert_user_error(again, f"'{run / 'tokenizer.json'}' (sha256 ", "is not the tokenizer checkpoint")
    score = cli_in_process(
        capsys, "eval", f"checkpoint.path={run / 'checkpoints' / 'last.dcp'}", f"out_dir={run}"
    )
    assert_user_error(score, "is not the tokenizer checkpoint")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
    (run / "tokenizer.json").write_text(ours)
    resumed = cli_in_process(capsys, "train", *run_args(run, corpus)[:-3], "train.max_steps=2")
    assert resumed.returncode == 0, resumed.stderr


class _Runs:
    def __reduce__(self):
        return (os.system, ("echo ran",))


def test_torchs_warnings_about_a_refused_checkpoint_are_not_shown(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"model": _Runs()}, protocol=4))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for argv in (["eval", f"checkpoint.path={evil}"], ["generate", str(evil), "--prompt", "x"]):
            assert_user_error(cli_in_process(capsys, *argv), f"checkpoint '{evil}' is unreadable")
    assert [
        str(w.message)[:40] for w in shown
    ] == []  # before: "Detected pickle protocol 4 in the checkpoint"
