"""The Llama-shaped families (model.arch=qwen2, qwen3, mistral: the Llama's blocks with q/k/v biases, per-head q/k
norms, a sliding window): trained under fsdp x tp2 and fsdp x pp2 on 4 real gloo processes, each equal to one
process after 6 steps. Budget: about 40 s (one 4-rank group of six 6-step runs, three one-process references in
this process)."""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_GLOBAL_BATCH, GPT_RUN, dist_context, plain, run_group, train_here

FAMILIES = {
    "qwen2": ["model.arch=qwen2", "model.n_kv_head=2"],
    "qwen3": ["model.arch=qwen3", "model.n_kv_head=2"],
    # a window shorter than the context (data.block_size=16): the mask is not the causal one
    "mistral": ["model.arch=mistral", "model.n_kv_head=2", "model.sliding_window=5"],
}
STEPS = ["train.max_steps=6"]
LAYOUTS = {  # on 4 processes, 2 samples per rank: the global batch of 8
    "fsdp-tp2": ["dist.strategy=fsdp", "dist.tp=2", "train.batch_size=4"],
    "fsdp-pp2": ["dist.strategy=fsdp", "dist.pp=2", "dist.pp_microbatches=2", "train.batch_size=4"],
}


def _weights(out) -> dict[str, torch.Tensor]:
    from ddpkit.checkpoint import load_checkpoint

    return load_checkpoint(out / "checkpoints" / "last.pt")["model"]


@pytest.fixture(scope="module")
def references(gpt_text, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Each family's one-process run, 6 steps, in this process."""
    out = {}
    for name, keys in FAMILIES.items():
        run = tmp_path_factory.mktemp(name) / "run"
        train_here(
            *GPT_RUN, *keys, *STEPS, f"out_dir={run}", f"data.root={gpt_text}",
            f"train.batch_size={GPT_GLOBAL_BATCH}",
        )  # fmt: skip
        out[name] = _weights(run)
    return out


def _layouts(rank: int, world_size: int, root: str, text: str) -> dict:
    from ddpkit.config import load_config
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    weights = {}
    for name, keys in FAMILIES.items():
        for layout, settings in LAYOUTS.items():
            run = [f"out_dir={root}/{name}-{layout}", f"data.root={text}", *STEPS, *settings]
            cfg = load_config(None, [*GPT_RUN, *keys, *run])
            with Heartbeat(rank, world_size) as heartbeat:
                trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
                trainer.fit()
                weights[name, layout] = plain(trainer.strategy.model_state(trainer.wrapped))
    return weights


def _assert_close(got: dict, want: dict, what: str) -> None:
    """Within 1e-4 of each tensor's scale (as tests/models/test_llama.py: SGD at lr 0.5 for 6 steps carries the
    float32 rounding of a layout's other order of sums into the weights)."""
    assert sorted(got) == sorted(want), what
    for k in want:
        scale = max(want[k].abs().max().item(), 1e-2)
        assert (torch.as_tensor(got[k]) - want[k]).abs().max().item() <= 1e-4 * scale, f"{what}: {k}"


@pytest.mark.slow
def test_each_family_under_fsdp_x_tp2_and_fsdp_x_pp2_equals_one_process(references, gpt_text, tmp_path):
    weights = run_group(_layouts, 4, str(tmp_path), str(gpt_text), timeout=600)[0]
    # the options are in the weights: q/k/v biases, the per-head norms (moved by training), no extra tensors
    assert (
        "blocks.0.attn.wq.bias" in references["qwen2"] and "blocks.0.attn.wq.bias" not in references["qwen3"]
    )
    assert (references["qwen3"]["blocks.1.attn.k_norm.weight"] != 1).all()
    assert len(weights) == len(FAMILIES) * len(LAYOUTS)
    for (name, layout), got in weights.items():
        _assert_close(got, references[name], f"{name} {layout}")
