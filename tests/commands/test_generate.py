"""The language-model loop around training: a BPE trained once and saved with the run, token files, `ddpkit
generate` from full and sharded checkpoints, Hugging Face weights in (`ddpkit.load_model`, `model.init_from`) and
out (`ddpkit export --to hf`), checked against transformers itself on tiny random models.

Budget: about 60 s on a quiet 2-core machine: one 2-process run (BPE, sharded checkpoints) and one 1-process run
(token files, a full checkpoint, started from a transformers GPT-2) serve every test here.
"""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch

from conftest import REPO, assert_user_error, cli_in_process, run_cli

transformers = pytest.importorskip("transformers")

TINY = [
    "data.block_size=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "train.batch_size=8",
    "train.epochs=1",
    "optim.name=adamw",
    "optim.lr=0.003",
    "optim.ref_batch_size=null",
    "report.curves=false",
]


def tiny_gpt2(folder, vocab: int, positions: int = 16, **extra):
    """A random transformers GPT-2 of the TINY shape saved in `folder`; returns it (eval mode)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2, **extra
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder)
    return model


DOC = REPO / "docs" / "language-model.md"


def doc_line(start: str) -> list[str]:
    """The words of docs/language-model.md's command line that starts with `start` (its config file the
    repository's, wherever the line runs)."""
    (line,) = [ln for ln in DOC.read_text().splitlines() if ln.startswith(start)]
    words = shlex.split(line)[1:]  # without `ddpkit`
    return [str(REPO / w) if w.startswith("configs/") else w for w in words]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """docs/language-model.md's loop, each line with a tiny model and text added: (a 2-process BPE run with sharded
    checkpoints, a 1-process run on token files from a GPT-2 folder, that GPT-2, the folder the runs are in)."""
    base = tmp_path_factory.mktemp("lm_loop")
    bpe, tokens = base / "runs" / "bpe", base / "runs" / "tokens"
    first = run_cli(
        *doc_line("ddpkit train -c configs/text_gpt.yaml data.tokenizer=bpe"),
        *TINY, "data.text_bytes=20000", "train.max_steps=3", timeout=600, cwd=base,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # token files written with numpy as the docs do, encoded by the first run's tokenizer; a GPT-2 to start from
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    ids = np.array(tok.encode("def main():\n    return 0\n" * 40).ids, np.uint16)
    (base / "bins").mkdir()
    ids[: len(ids) * 9 // 10].tofile(base / "bins" / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(base / "bins" / "val.bin")
    ref = tiny_gpt2(base / "gpt2-tiny", tok.get_vocab_size())
    second = run_cli(
        *doc_line("ddpkit train -c configs/text_gpt.yaml data.dataset=tokens"), *TINY, "train.max_steps=2",
        "optim.lr=1e-9", "train.peak_tflops=0.002", timeout=600, cwd=base,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    return bpe, tokens, ref, base


@pytest.mark.slow
def test_a_bpe_run_saves_its_tokenizer_and_generate_repeats_greedy_text_from_sharded_checkpoints(
    runs, capsys
):
    bpe, _, _, _ = runs
    from tokenizers import Tokenizer

    from ddpkit.checkpoint import load_checkpoint

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    assert tok.get_vocab_size() == 256 and (bpe / "checkpoints" / "best.dcp").is_dir()
    side = load_checkpoint(bpe / "checkpoints" / "best.dcp")  # the tokenizer travels with each checkpoint too
    assert side["tokenizer"] == (bpe / "tokenizer.json").read_text()
    # the docs' two lines, in this process with absolute paths and 12 new tokens; the seed varied below
    here = {"runs/bpe": str(bpe), "runs/bpe/checkpoints/last.dcp": str(bpe / "checkpoints" / "last.dcp")}
    greedy = [here.get(w, w) for w in doc_line("ddpkit generate runs/bpe ")] + ["--max-new-tokens", "12"]
    seeded = [here.get(w, w) for w in doc_line("ddpkit generate runs/bpe/")] + ["--max-new-tokens", "12"]
    seeded = seeded[: seeded.index("--seed")] + seeded[seeded.index("--seed") + 2 :]
    one, two, s1, s1b, s2 = (
        cli_in_process(capsys, *argv)
        for argv in (
            greedy,
            greedy,
            [*seeded, "--seed", "1"],
            [*seeded, "--seed", "1"],
            [*seeded, "--seed", "2"],
        )
    )
    for proc in (one, two, s1, s1b, s2):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.startswith("import os") and len(proc.stdout) > len("import os\n")
    assert one.stdout == two.stdout  # greedy: the same text every time
    assert s1.stdout == s1b.stdout and s1.stdout != s2.stdout  # sampled: the seed decides


@pytest.mark.slow
def test_token_files_train_from_a_gpt2_folder_and_export_back_to_transformers(runs, capsys):
    _, tokens, ref, base = runs
    import ddpkit

    assert (tokens / "tokenizer.json").is_file() and (tokens / "checkpoints" / "last.pt").is_file()
    model = ddpkit.load_model(tokens)  # the run's best.pt: GPT-2's weights moved by a learning rate of 1e-9
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max() < 1e-4
        export = run_cli(*doc_line("ddpkit export runs/tokens"), cwd=base)  # the docs' line
        assert export.returncode == 0, export.stderr
        hf = base / "runs" / "tokens-hf"
        back = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        assert (back(x).logits - model(x)).abs().max() < 1e-4
    assert (hf / "tokenizer.json").read_text() == (tokens / "tokenizer.json").read_text()
    proc = cli_in_process(capsys, "generate", str(tokens), "--prompt", "def", "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout.startswith("def")
    alone = base / "alone.pt"  # a checkpoint copied away from its run: its own tokenizer entry serves
    alone.write_bytes((tokens / "checkpoints" / "best.pt").read_bytes())
    again = cli_in_process(capsys, "generate", str(alone), "--prompt", "def", "--temperature", "0")
    assert again.returncode == 0 and again.stdout == proc.stdout
    assert_user_error(
        cli_in_process(capsys, "export", str(tokens), "--to", "hf", str(hf)),
        "not an empty folder",
    )


@pytest.mark.slow
def test_metrics_hold_flops_per_token_tflops_mfu_and_peak_memory_and_report_shows_them(runs, capsys):
    from ddpkit.models.gpt.model import GPT
    from ddpkit.train.metrics import read_metrics

    bpe, tokens, _, _ = runs
    for out, peak in ((bpe, None), (tokens, 0.002)):
        (row,) = read_metrics(out)
        n_embd, block = 16, 16
        model = GPT(256, block, n_layer=1, n_head=2, n_embd=n_embd, tie_embeddings=out == tokens)
        n = sum(p.numel() for p in model.parameters()) - block * n_embd  # tied head once, no positions
        assert row["flops_per_token"] == 6 * n + 12 * 1 * n_embd * block
        want = row["flops_per_token"] * row["train_tokens_per_s"] / row["world_size"] / 1e12
        assert row["tflops_per_s_per_rank"] == pytest.approx(want, rel=1e-5)
        assert row["mfu"] == (None if peak is None else pytest.approx(want / peak, rel=1e-5))
        assert 10 << 20 < row["peak_memory_bytes_per_rank"] < 64 << 30  # a CPU process's peak RSS
    proc = cli_in_process(capsys, "report", str(tokens), str(bpe), "--out", str(tokens.parent / "r.png"))
    assert proc.returncode == 0, proc.stderr
    assert "| TFLOP/s per rank | MFU | peak memory per rank (MiB) |" in proc.stdout
    (row,) = read_metrics(tokens)
    assert f"| {100 * row['mfu']:.2f}% |" in proc.stdout


@pytest.mark.parametrize("tied", [True, False])
def test_a_transformers_gpt2_loads_with_equal_logits(tmp_path, tied):
    import ddpkit

    ref = tiny_gpt2(tmp_path, 50, tie_word_embeddings=tied, activation_function="gelu_new")
    model = ddpkit.load_model(tmp_path)
    assert not model.training and model.tie_embeddings is tied
    x = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max() < 1e-4


def test_a_sharded_transformers_folder_loads_too(tmp_path):
    import ddpkit

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert (ddpkit.load_model(tmp_path)(x) - ref(x).logits).abs().max() < 1e-4


def test_bad_inputs_of_generate_export_and_load_model_are_one_line(tmp_path, capsys):
    from ddpkit import config
    from ddpkit.checkpoint import save_checkpoint
    from ddpkit.errors import UserError
    from ddpkit.models.hf import read_tensors
    from ddpkit.models.loading import load_model

    save_checkpoint(
        {"model": {"fc.weight": torch.zeros(2, 2)}, "config": config.to_dict(config.load_config(None, []))},
        tmp_path / "mlp.pt",
    )
    cases = [
        (
            ["generate", str(tmp_path / "mlp.pt"), "--prompt", "x"],
            "an image classifier, not a language model",
        ),
        (["generate", str(tmp_path), "--prompt", "x"], "holds no checkpoint"),
        (["generate", str(tmp_path / "none"), "--prompt", "x"], "does not exist"),
        (["generate", str(tmp_path), "--prompt", ""], "--prompt is empty"),
        (["export", str(tmp_path / "mlp.pt"), "--to", "hf", str(tmp_path / "o")], "not a language model"),
    ]
    for argv, fragment in cases:
        assert_user_error(cli_in_process(capsys, *argv), fragment)
    neox = tmp_path / "neox"
    transformers.GPTNeoXConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(neox)
    with pytest.raises(UserError, match="type 'gpt_neox'; ddpkit reads the GPT-2"):
        load_model(neox)
    odd = tmp_path / "odd"
    tiny_gpt2(odd, 50, n_inner=24)
    with pytest.raises(UserError, match="n_inner=24"):
        load_model(odd)
    (odd / "model.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(UserError, match="cannot read"):
        read_tensors(odd)


def test_init_from_refuses_a_folder_of_another_shape_or_kind_in_one_line(tmp_path):
    from ddpkit import models
    from ddpkit.config import load_config
    from ddpkit.errors import UserError
    from ddpkit.models.gpt.model import GPT
    from ddpkit.models.llama.model import Llama
    from ddpkit.models.loading import init_from

    tiny_gpt2(tmp_path / "gpt2", 50)  # GPT-2's tanh GELU and tied head
    folder = str(tmp_path / "gpt2")
    with pytest.raises(UserError, match="gelu_approximate=tanh"):
        init_from(GPT(50, 16, n_layer=1, n_head=2, n_embd=16), folder)
    with pytest.raises(UserError, match="has n_embd=16 but this config gives 32"):
        init_from(GPT(50, 16, 1, 2, 32, gelu_approximate="tanh", tie_embeddings=True), folder)
    with pytest.raises(
        UserError, match=r"tensor tok_emb.weight is \(50, 16\) but this model's is \(60, 16\)"
    ):
        init_from(GPT(60, 16, 1, 2, 16, gelu_approximate="tanh", tie_embeddings=True), folder)
    with pytest.raises(UserError, match="holds a gpt model, not a Llama"):
        init_from(Llama(50, 16, n_layer=1, n_head=2, n_embd=16), folder)
    init_from(model := GPT(50, 16, 1, 2, 16, gelu_approximate="tanh", tie_embeddings=True), folder)
    assert model.head.weight is model.tok_emb.weight
    for bad, fragment in (
        ([f"model.init_from={tmp_path}"], "is not a Hugging Face folder"),
        (
            ["model.arch=mlp", "data.dataset=digits", f"model.init_from={folder}"],
            "model.arch=mlp but model.init_from .* has model_type='gpt2'",
        ),
    ):
        with pytest.raises(UserError, match=fragment):
            models.check_arch(load_config(None, ["model.arch=gpt", "data.dataset=text", *bad]))
