"""The built-in Llama (model.arch=llama): equal to transformers' LlamaForCausalLM on tiny random models (grouped-query
attention, RoPE base, tied head), exported back, and trained under tensor parallelism with activation
checkpointing, under fsdp and under zero2 x tensor x pipeline parallelism on 8 processes, and tied under FSDP,
equal to one process. Budget: about 110 s (four `ddpkit train` runs of 6 steps, two on 2 processes and two on 8,
and the two one-process references in this process)."""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_GLOBAL_BATCH, GPT_RUN, assert_user_error, cli_in_process, gpt_train, train_here
from ddpkit.errors import UserError

transformers = pytest.importorskip("transformers")

LLAMA = [*GPT_RUN, "model.arch=llama", "model.n_kv_head=2", "model.rope_theta=500"]


@pytest.mark.parametrize(
    ("kv", "tied", "theta"), [(1, False, 500.0), (2, True, 10000.0), (4, False, 10000.0)]
)
def test_a_transformers_llama_loads_and_exports_with_equal_logits(tmp_path, kv, tied, theta):
    import ddpkit
    from ddpkit.models import family_of_module
    from ddpkit.models.hf import export

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, rope_theta=theta, tie_word_embeddings=tied, max_position_embeddings=32,
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "hf")
    model = ddpkit.load_model(tmp_path / "hf")
    assert (model.n_kv_head, model.tie_embeddings, model.rope_theta) == (kv, tied, theta)
    x = torch.randint(0, 40, (2, 20))
    export(model, tmp_path / "back", family_of_module(model))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max() < 1e-4
        assert (back(x).logits - model(x)).abs().max() < 1e-4


def test_unsupported_llama_settings_are_one_line(tmp_path):
    from ddpkit.models.loading import load_model

    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        attention_bias=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="biases"):
        load_model(tmp_path)


def _last_weights(out) -> dict:
    from ddpkit.checkpoint import load_checkpoint

    return load_checkpoint(out / "checkpoints" / "last.pt")["model"]


def _assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        scale = max(want[k].abs().max().item(), 1e-2)
        assert (got[k] - want[k]).abs().max().item() <= 1e-4 * scale, k


def _reference_beside(text, args: list[str], one, many, nproc: int, *more: str, dp: int | None = None):
    """The one-process run of GPT_RUN + `args` in this process (the Trainer that `ddpkit train` runs, without
    starting a process) into `one`, while `ddpkit train` of the same + `more` on `nproc` processes runs beside
    it into `many`; -> that run's CompletedProcess."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        beside = pool.submit(gpt_train, many, text, nproc, *args, *more, dp=dp)
        train_here(
            *GPT_RUN, f"out_dir={one}", f"data.root={text}", f"train.batch_size={GPT_GLOBAL_BATCH}", *args
        )
        return beside.result()


@pytest.mark.slow
def test_a_tied_llama_under_fsdp_equals_one_process(gpt_text, tmp_path):
    # the head shares the token embedding: FSDP keeps the shared weight in the root's shard group, once
    tied = [*LLAMA[len(GPT_RUN) :], "model.tie_embeddings=true", "train.max_steps=6"]
    _reference_beside(gpt_text, tied, tmp_path / "one", tmp_path / "fsdp", 2, "dist.strategy=fsdp")
    one, fsdp = _last_weights(tmp_path / "one"), _last_weights(tmp_path / "fsdp")
    _assert_close(fsdp, one)
    assert torch.equal(fsdp["head.weight"], fsdp["tok_emb.weight"])


@pytest.fixture(scope="module")
def llama_one(gpt_text, tmp_path_factory) -> dict:
    """The one-process run of LLAMA, 6 steps, in this process: the weights every layout below must reach."""
    from ddpkit.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("llama_one") / "run"
    train_here(
        *LLAMA, f"out_dir={out}", f"data.root={gpt_text}", f"train.batch_size={GPT_GLOBAL_BATCH}", *STEPS
    )
    assert load_checkpoint(out / "checkpoints" / "last.pt")["config"]["model"]["arch"] == "llama"
    return _last_weights(out)


STEPS = ["train.max_steps=6"]


@pytest.mark.slow
def test_llama_under_tensor_parallelism_with_checkpointing_equals_one_process(
    llama_one, gpt_text, tmp_path, capsys
):
    gpt_train(
        tmp_path / "tp", gpt_text, 2, *LLAMA[len(GPT_RUN) :], *STEPS, "dist.tp=2",
        "model.activation_checkpointing=full", dp=1,
    )  # fmt: skip
    assert "blocks.1.mlp.gate.weight" in llama_one
    _assert_close(_last_weights(tmp_path / "tp"), llama_one)
    for bad, fragment in (
        (["model.n_kv_head=1", "dist.tp=2"], "model.n_kv_head=1 cannot be split over dist.tp=2"),
        (["model.n_kv_head=3"], "not a multiple of model.n_kv_head=3"),
        (
            ["dist.pp=2", "model.n_layer=3"],
            "model.n_layer=3 blocks cannot be cut into 2 equal pipeline stages",
        ),
        (["model.tie_embeddings=true", "dist.tp=2"], "model.tie_embeddings=true is not supported"),
    ):
        argv = ["train", f"out_dir={tmp_path / 'bad'}", f"data.root={gpt_text}", *LLAMA, *bad]
        proc = cli_in_process(capsys, *argv, "--nproc-per-node", "2")  # refused before any worker starts
        assert_user_error(proc, fragment)
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_llama_under_lean_fsdp_with_checkpointing_equals_one_process(llama_one, gpt_text, tmp_path, capsys):
    # dist.memory=lean: each block's attention and MLP gathered as FSDP2 units of their own, no backward prefetch
    gpt_train(
        tmp_path / "lean", gpt_text, 2, *LLAMA[len(GPT_RUN) :], *STEPS, "dist.strategy=fsdp", "dist.memory=lean",
        "model.activation_checkpointing=full",
    )  # fmt: skip
    _assert_close(_last_weights(tmp_path / "lean"), llama_one)
    for bad, fragment in (
        (
            ["dist.strategy=ddp"],
            "dist.memory=lean shards each block's parts with FSDP2, which dist.strategy=ddp",
        ),
        (["dist.strategy=fsdp", "dist.memory=small"], "dist.memory"),
    ):
        argv = [
            "train",
            f"out_dir={tmp_path / 'bad'}",
            f"data.root={gpt_text}",
            *LLAMA,
            "dist.memory=lean",
            *bad,
        ]
        proc = cli_in_process(capsys, *argv, "--nproc-per-node", "2")  # refused before any worker starts
        assert_user_error(proc, fragment)
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_llama_under_sharded_data_parallel_x_tp2_x_pp2_on_8_processes_equals_one_process(
    llama_one, gpt_text, tmp_path, strategy
):
    # its family's pipeline cut (at its blocks, models/blocks.py) and tensor plan on the 3-D layout: `strategy`
    # over dp=2 x tp=2 x pp=2
    three_d = gpt_train(
        tmp_path / "pp", gpt_text, 8, *LLAMA[len(GPT_RUN) :], *STEPS, "dist.tp=2", "dist.pp=2",
        f"dist.strategy={strategy}", "dist.pp_microbatches=2", "--oversubscribe", dp=2,
    )  # fmt: skip
    assert f"strategy {strategy}, pipeline 2 stages (1f1b) over dp=2 x tp=2 x pp=2" in three_d.stdout
    _assert_close(_last_weights(tmp_path / "pp"), llama_one)
