"""Hugging Face mixtures of experts in and out: a Mixtral folder saved by transformers (each routed expert's w1,
w3, w2 a tensor of its own) read by ddpkit.load_model and model.init_from, its logits transformers' within 1e-4,
and `ddpkit export --to hf` writing a model trained under expert parallelism back so that transformers reads it
with the same logits; what a Mixtral folder cannot hold refused in one line. Budget: about 25 s (a 2-rank group of
one 2-step run beside its one-process reference, an export)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_user_error, cli_in_process, dist_context, plain, run_group, train_here

transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY |= {"num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny transformers Mixtral (4 experts, top-2) saved in three safetensors files with an index."""
    path = tmp_path_factory.mktemp("mixtral") / "hf"
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def test_a_mixtral_folder_reads_and_writes_with_transformers_logits(mixtral, tmp_path):
    import ddpkit
    from ddpkit.models import family_of_module
    from ddpkit.models.hf import export

    theirs = transformers.MixtralForCausalLM.from_pretrained(mixtral).eval()
    model = ddpkit.load_model(mixtral)
    assert type(model).__name__ == "Mixtral" and tuple(model.blocks["1"].mlp.experts.down.shape) == (
        4,
        32,
        48,
    )
    x = torch.randint(0, 64, (2, 12))
    want = _logits(theirs, x)
    torch.testing.assert_close(_logits(model, x), want, rtol=1e-4, atol=1e-5)
    out = export(model, tmp_path / "back", family_of_module(model))
    back = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(back, x), want, rtol=1e-4, atol=1e-5)
    assert (out / "model.safetensors").is_file()  # each expert's matrices named as transformers writes them
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()


def test_what_a_mixtral_folder_cannot_hold_is_one_line(mixtral, tmp_path):
    import json
    import shutil

    import ddpkit
    from ddpkit.config import load_config
    from ddpkit.errors import UserError
    from ddpkit.models import model_family
    from ddpkit.models.hf import export

    cfg = load_config(
        None, ["model.arch=llama", "model.n_experts=4", "model.moe_every=2", "data.dataset=text"]
    )
    family = model_family("llama", cfg.model)
    with pytest.raises(UserError, match="a Mixtral folder cannot hold model.moe_every=2"):
        export(family.build_lm("llama", 50, 16, cfg.model), tmp_path / "x", family)
    assert not (tmp_path / "x").exists()
    windowed = tmp_path / "windowed"
    shutil.copytree(mixtral, windowed)
    raw = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**raw, "sliding_window": 8}))
    with pytest.raises(UserError, match="asks for a sliding window of attention"):
        ddpkit.load_model(windowed)


RUN = [
    "model.arch=llama",  # with the folder's experts: the mixtral family's
    "data.dataset=tokens",
    "data.block_size=16",
    "train.max_steps=2",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.ref_batch_size=null",
    "optim.schedule=constant",
    "optim.warmup_epochs=0",
    "report.curves=false",
    "checkpoint.format=sharded",
]


def _ep2(rank: int, world_size: int, out: str, *settings: str) -> dict:
    from ddpkit.config import load_config
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    with Heartbeat(rank, world_size) as heartbeat:
        trainer = Trainer(
            load_config(None, [f"out_dir={out}", *RUN, *settings]), dist_context(rank, world_size), heartbeat
        )
        trainer.fit()
        return plain(trainer.strategy.model_state(trainer.wrapped))


@pytest.mark.slow
def test_init_from_a_mixtral_folder_under_ep_trains_as_one_process_and_exports_back(
    mixtral, tmp_path, capsys
):
    import ddpkit
    from ddpkit.checkpoint.sharded import read_model

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 64, 400, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    run = [f"model.init_from={mixtral}", f"data.root={tmp_path}"]
    ep = run_group(_ep2, 2, str(tmp_path / "ep2"), *run, "dist.ep=2", "train.batch_size=4", timeout=300)[0]
    train_here(*RUN, f"out_dir={tmp_path / 'one'}", *run, "train.batch_size=8")
    one = read_model(tmp_path / "one" / "checkpoints" / "last.dcp")
    assert set(one) == set(ep) and "blocks.0.mlp.experts.gate" in one
    for k, v in one.items():
        torch.testing.assert_close(torch.as_tensor(ep[k]), v, rtol=1e-4, atol=1e-6, msg=k)
    assert "model.init_from: every tensor from" in (tmp_path / "ep2" / "log.txt").read_text()
    # the ep run's sharded checkpoint, never gathered, written back as a Mixtral folder transformers reads
    proc = cli_in_process(capsys, "export", str(tmp_path / "ep2"), "--to", "hf", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(
        _logits(back, x), _logits(ddpkit.load_model(tmp_path / "ep2"), x), rtol=1e-4, atol=1e-5
    )
    bad = cli_in_process(capsys, "train", f"out_dir={tmp_path / 'bad'}", *RUN, *run, "model.n_experts=8")
    assert_user_error(bad, "model.n_experts=8", "model.init_from")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny transformers Qwen3-MoE (4 experts, top-2, weights not renormalized): block 0 a dense SwiGLU, block 1
    of experts (decoder_sparse_step=2), the heads' q and k norms, heads of 16 (not hidden_size / heads = 8)."""
    path = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        **TINY, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, norm_topk_prob=False, head_dim=16,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so that reading them matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def test_a_qwen3_moe_folder_reads_trains_and_writes_with_transformers_logits(qwen3_moe, tmp_path):
    import ddpkit
    from ddpkit.models import family_of_module
    from ddpkit.models.hf import export

    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(qwen3_moe).eval()
    model = ddpkit.load_model(qwen3_moe)
    assert type(model).__name__ == "Qwen3Moe" and model.moe_every == 2 and not model.moe_norm_topk
    assert model.head_dim == 16
    assert tuple(model.blocks["1"].mlp.experts.down.shape) == (4, 32, 24)
    x = torch.randint(0, 64, (2, 12))
    want = _logits(theirs, x)
    torch.testing.assert_close(_logits(model, x), want, rtol=1e-4, atol=1e-5)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        export(model, tmp_path / "back", family_of_module(model))
    )
    torch.testing.assert_close(_logits(back.eval(), x), want, rtol=1e-4, atol=1e-5)
    # model.init_from: the folder's keys and weights, 2 steps in this process, exported back for transformers
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 64, 400, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    run = tmp_path / "run"
    train_here(
        *RUN[1:],
        f"out_dir={run}",
        f"model.init_from={qwen3_moe}",
        f"data.root={tmp_path}",
        "train.batch_size=8",
    )
    trained = ddpkit.load_model(run)
    assert type(trained).__name__ == "Qwen3Moe"
    assert not torch.equal(trained.blocks["1"].mlp.experts.gate, model.blocks["1"].mlp.experts.gate)
    out = export(trained, tmp_path / "trained", family_of_module(trained))
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(again, x), _logits(trained, x), rtol=1e-4, atol=1e-5)
