"""Language models: data.dataset=text, model.arch=gpt, their metrics, best checkpoint and `ddpkit eval`.

Time budget: about 60 s on a quiet 2-core machine. The commands of docs/language-model.md (train on 2 processes,
eval, report: one run), one in-process 2-rank group that trains under ddp, zero1 and fsdp, and one bench on 1
process are shared by the tests through module fixtures; everything else runs in this process on a few kilobytes
of text.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import REPO, assert_user_error, run_cli, run_group
from ddpkit import data, models
from ddpkit.commands import report
from ddpkit.config import load_config
from ddpkit.data import text
from ddpkit.errors import UserError
from ddpkit.train import memory
from ddpkit.train import metrics_file as metrics_schema
from ddpkit.train.curves import drawing
from ddpkit.train.metrics import read_metrics

# a tiny GPT on the first 40 kB of the standard library's sources: a few steps, well under a second each
TINY = [
    "model.arch=gpt",
    "data.dataset=text",
    "data.text_bytes=40000",
    "data.block_size=32",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "train.batch_size=8",
    "optim.name=adamw",
    "optim.lr=0.003",
    "optim.ref_batch_size=null",
    "optim.schedule=constant",
    "report.curves=false",
]


def tiny_config(out_dir, *overrides: str):
    return load_config(None, [f"out_dir={out_dir}", *TINY, *overrides])


# ---------------------------------------------------------------------------------------------------------------
# the text data set


def test_default_source_is_the_standard_library_bounded_and_the_same_each_time(tmp_path):
    cfg = tiny_config(tmp_path / "run", "data.text_bytes=5000")
    first = text.stdlib_files()[0].read_bytes()[:5000].decode("utf-8", errors="ignore")
    got = text.read_text(cfg)
    assert got == text.read_text(cfg) and len(got.encode("utf-8")) <= 5000
    assert got.startswith(first[:1000])


def test_samples_are_shifted_blocks_over_a_sorted_vocabulary(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello, world. " * 200)
    cfg = tiny_config(tmp_path / "run", f"data.root={corpus}", "data.block_size=8")
    train, val, spec = data.build_datasets(cfg)
    assert spec.vocab_size == len(set("hello, world. ")) and spec.block_size == 8
    assert len(val) == (280 - 1) // 8 and len(train) == (2800 - 280 - 1) // 8  # the last tenth is validation
    x, y = train[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    vocab = sorted(set("hello, world. "))
    assert "".join(vocab[i] for i in x) == ("hello, world. " * 200)[24:32]
    assert torch.equal(x[1:], y[:-1])


def test_a_folder_is_read_in_name_order_without_hidden_files(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("b" * 400)
    (folder / "sub" / "c.txt").write_text("c" * 400)
    (folder / "a.txt").write_text("a" * 400)
    (folder / ".hidden").write_bytes(b"\0binary")
    cfg = tiny_config(tmp_path / "run", f"data.root={folder}", "data.block_size=8")
    assert text.read_text(cfg) == "a" * 400 + "b" * 400 + "c" * 400


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "does not exist"),
        (b"", "holds no text"),
        (b"text\0with a NUL", "is a binary file"),
        (b"\xff\xfe not utf-8 " * 40, "is not UTF-8 text"),
        (b"short", "too few for data.block_size=32"),
    ],
)
def test_a_bad_text_source_is_one_error_line(tmp_path, content, fragment):
    root = tmp_path / "corpus.txt"
    if content is not None:
        root.write_bytes(content)
    with pytest.raises(UserError, match=fragment):
        data.check_available(tiny_config(tmp_path / "run", f"data.root={root}"))


def test_the_command_refuses_bad_text_and_mismatched_model_and_data_before_writing(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"\0\1\2" * 100)
    out = tmp_path / "run"
    proc = run_cli("train", *TINY, f"data.root={tmp_path / 'bin.txt'}", f"out_dir={out}")
    assert_user_error(proc, "is a binary file")
    assert not out.exists()
    with pytest.raises(UserError, match="model.arch=gpt is a language model"):
        models.check_arch(load_config(None, ["model.arch=gpt"]))
    with pytest.raises(UserError, match="use model.arch=gpt"):
        models.check_arch(load_config(None, ["data.dataset=text"]))
    with pytest.raises(UserError, match="not a multiple of model.n_head"):
        models.check_arch(load_config(None, [*TINY, "model.n_embd=30", "model.n_head=4"]))


# ---------------------------------------------------------------------------------------------------------------
# docs/language-model.md's commands: `ddpkit train -c configs/text_gpt.yaml` on 2 processes, `ddpkit eval` of its
# checkpoint, `ddpkit report` of its run; each line as the docs show it, with a tiny model and text added

RECIPE = str(REPO / "configs" / "text_gpt.yaml")
# two epochs of the tiny text (the recipe's step budget, 200, ends no run this short)
SMALL = [
    *(k for k in TINY if not k.startswith(("optim.", "report."))),
    "data.text_bytes=3000",
    "train.epochs=2",
]


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lm")
    train = run_cli("train", "-c", RECIPE, "--nproc-per-node", "2", *SMALL, cwd=cwd)
    assert train.returncode == 0, train.stderr[-3000:]
    best = "checkpoint.path=runs/text_gpt/checkpoints/best.pt"
    ev = run_cli("eval", "-c", RECIPE, best, *SMALL, cwd=cwd)
    assert ev.returncode == 0, ev.stderr[-3000:]
    rep = run_cli("report", "runs/text_gpt", "--out", "text_gpt.png", cwd=cwd)
    assert rep.returncode == 0, rep.stderr[-3000:]
    return cwd / "runs" / "text_gpt", train.stdout, json.loads(ev.stdout.strip().splitlines()[-1]), rep.stdout


@pytest.mark.slow
def test_language_model_metrics_hold_loss_perplexity_and_tokens(doc_run):
    out, stdout, _, _ = doc_run
    rows = read_metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["step"] == 2 * rows[0]["step"]
    for r in rows:
        assert r["val_acc1"] is None and r["val_acc5"] is None and r["train_acc1"] is None
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["train_tokens_per_s"] > 0 and r["world_size"] == 2
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    epoch_lines = [ln for ln in stdout.splitlines() if ln.startswith("epoch ")]
    assert len(epoch_lines) == 2 and all(
        "ppl" in ln and "tokens/s" in ln and "acc" not in ln for ln in epoch_lines
    )


@pytest.mark.slow
def test_every_metrics_line_follows_the_schema(doc_run):
    out, _, _, _ = doc_run
    first, second = read_metrics(out)
    for row in (first, second):
        assert set(metrics_schema.EVERY_LINE) <= set(row) and metrics_schema.bad_value(row) is None
    only_first = {f.name for f in metrics_schema.FIELDS if f.lines == "first"}
    assert only_first <= set(first) and not only_first & set(second)
    assert first["backend"] == "gloo" and first["device"] == "cpu"


@pytest.mark.slow
def test_best_checkpoint_of_a_language_model_is_its_lowest_val_loss(doc_run):
    out, _, _, _ = doc_run
    rows = read_metrics(out)
    best = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    lowest = min(r["val_loss"] for r in rows)
    assert best["best_val_loss"] == pytest.approx(lowest) and best["metrics_row"]["val_loss"] == lowest
    assert best["best_acc1"] == -1.0


@pytest.mark.slow
def test_eval_scores_the_checkpoint_as_training_did(doc_run):
    out, _, result, _ = doc_run
    row = min(read_metrics(out), key=lambda r: r["val_loss"])
    assert result["val_loss"] == pytest.approx(row["val_loss"], rel=1e-6)
    assert result["val_samples"] == row["val_samples"] and result["val_acc1"] is None
    assert result["val_ppl"] == pytest.approx(row["val_ppl"], rel=1e-6)


@pytest.mark.slow
def test_report_shows_a_language_models_loss_perplexity_and_tokens(doc_run, tmp_path):
    out, _, _, table = doc_run
    rows = read_metrics(out)
    assert "final val_loss" in table and "mean tokens/s" in table
    assert f"| {rows[-1]['val_loss']:.4f} |" in table and f"| {rows[-1]['val_ppl']:.2f} |" in table
    assert (out.parent.parent / "text_gpt.png").is_file() and (out / "curves.png").is_file()
    run = report.load_run(out)
    summary = report.summarize(run, "lm", [], None)
    assert summary["final_val_ppl"] == rows[-1]["val_ppl"] and summary["series"]["val_ppl"] == [
        r["val_ppl"] for r in rows
    ]
    assert [name for name, _ in drawing.panels([run])][1::2] == ["val perplexity", "training tokens/s"]


@pytest.mark.slow
def test_bench_measures_a_language_models_tokens_per_second(tmp_path):
    js = tmp_path / "b.json"
    proc = run_cli("bench", "-c", RECIPE, "--nproc", "1", "--steps", "2", *SMALL, "--json", str(js))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (one,) = json.loads(js.read_text())["results"]
    assert one["steps"] == 2 and one["tokens_per_s"] > 0 and one["backend"] == "gloo"
    assert one["tokens_per_s"] == pytest.approx(one["images_per_s"] * 32, rel=0.02)
    assert "tokens/s" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# the same steps under every data-parallel strategy (one 2-rank group) and on one process


def _strategies(rank: int, world_size: int, root: str) -> dict:
    from ddpkit.cluster.env import DistEnv
    from ddpkit.distributed.runtime import DistContext
    from ddpkit.train.trainer import Trainer

    launcher = "manual" if world_size > 1 else "none"
    env = DistEnv(
        rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, launcher=launcher
    )
    ctx = DistContext(env, "gloo", torch.device("cpu"))
    names = ("ddp", "zero1", "fsdp") if world_size > 1 else ("single",)
    per_rank = 8 // world_size  # the same global batch on 1 and on 2 processes
    rows = {}
    for name in names:
        overrides = (f"dist.strategy={name}", f"train.batch_size={per_rank}", "train.max_steps=4")
        cfg = tiny_config(f"{root}/{name}", "train.epochs=1", *overrides)
        rows[name] = Trainer(cfg, ctx).fit()
    return rows


@pytest.fixture(scope="module")
def strategy_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    two = run_group(_strategies, 2, str(root), timeout=300)[0]
    one = _strategies(0, 1, str(root))  # one process: this one (no process group to make)
    return {**two, **one}


@pytest.mark.slow
def test_ddp_zero1_and_fsdp_train_the_gpt_like_one_process(strategy_rows):
    single = strategy_rows["single"]
    for name in ("ddp", "zero1", "fsdp"):
        row = strategy_rows[name]
        assert row["train_loss"] == pytest.approx(single["train_loss"], rel=1e-4), name
        assert row["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4), name


@pytest.mark.slow
def test_memory_fields_show_what_each_strategy_shards(strategy_rows):
    single, ddp, zero1, fsdp = (strategy_rows[n] for n in ("single", "ddp", "zero1", "fsdp"))
    for row in (single, ddp, zero1, fsdp):
        assert min(row[f] for f in memory.FIELDS) > 0
    assert ddp["param_bytes_per_rank"] == single["param_bytes_per_rank"] == zero1["param_bytes_per_rank"]
    assert ddp["optim_bytes_per_rank"] == single["optim_bytes_per_rank"]
    assert fsdp["param_bytes_per_rank"] <= 0.6 * ddp["param_bytes_per_rank"]
    assert fsdp["grad_bytes_per_rank"] <= 0.6 * ddp["grad_bytes_per_rank"]
    assert fsdp["optim_bytes_per_rank"] <= 0.6 * ddp["optim_bytes_per_rank"]
    assert zero1["optim_bytes_per_rank"] <= 0.6 * ddp["optim_bytes_per_rank"]


def test_storage_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:], flat]
    assert memory.storage_bytes([*views, None]) == 400
    assert memory.storage_bytes([torch.zeros(10, dtype=torch.float64), torch.zeros(3)]) == 92
