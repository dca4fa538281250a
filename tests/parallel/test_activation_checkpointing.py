"""model.activation_checkpointing=selective (torch's op-level selective recomputation around every block: the matmul
and attention outputs kept, the cheap ops re-computed in backward): `ddpkit train`'s Trainer ends with the weights of
model.activation_checkpointing=none to 1e-6, with dropout on (the recomputation replays the random stream) for the
GPT and the Llama in one process, and under tp2 (the Llama, against tp2 without it) on 2 pooled ranks; one step's peak
of live tensor bytes (torch's MemTracker, exact on the CPU) lies strictly between none's and full's.

Time budget: about 15 s on a quiet 2-core machine (four 6-step one-process runs of the tiny transformers in this
process, a 2-rank group of two 6-step tensor-parallel runs, three tracked steps of a small GPT).
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_RUN, dist_context, plain, run_group, train_here
from ddpkit.checkpoint import load_checkpoint
from ddpkit.config import load_config

RUN = [*GPT_RUN, "train.batch_size=8", "train.max_steps=6"]
LLAMA = ["model.arch=llama", "model.n_kv_head=2"]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoints" / "last.pt")["model"]


def _assert_equal_to_1e6(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(got[k]), ref[k], rtol=0, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, gpt_text) -> dict[str, dict]:
    """model.activation_checkpointing=none in this process: the GPT with dropout, and each family without."""
    runs = {"gpt-dropout": ["model.dropout=0.1"], "gpt": [], "llama": LLAMA}
    out = {}
    for name, extra in runs.items():
        run = tmp_path_factory.mktemp(name) / "run"
        train_here(*RUN, *extra, f"out_dir={run}", f"data.root={gpt_text}")
        out[name] = _weights(run)
    return out


@pytest.mark.parametrize("family", ["gpt-dropout", "llama"])
def test_selective_recomputation_equals_none_in_one_process(family, plain_runs, gpt_text, tmp_path):
    extra = ["model.dropout=0.1"] if family == "gpt-dropout" else LLAMA
    train_here(
        *RUN,
        *extra,
        "model.activation_checkpointing=selective",
        f"out_dir={tmp_path}",
        f"data.root={gpt_text}",
    )
    _assert_equal_to_1e6(_weights(tmp_path), plain_runs[family])
    if family == "gpt-dropout":  # the dropout was on: the recomputation replayed its random masks
        with pytest.raises(AssertionError):
            _assert_equal_to_1e6(plain_runs["gpt-dropout"], plain_runs["gpt"])


def _tp2(rank: int, world_size: int, root: str, text: str) -> dict:
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    out = {}
    for mode in ("none", "selective"):
        keys = [*RUN, *LLAMA, "dist.tp=2", f"out_dir={root}/{mode}", f"data.root={text}"]
        cfg = load_config(None, [*keys, f"model.activation_checkpointing={mode}"])
        with Heartbeat(rank, world_size) as heartbeat:
            trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
            trainer.fit()
            out[mode] = plain(trainer.strategy.model_state(trainer.wrapped))
    return out


@pytest.mark.slow
def test_selective_recomputation_under_tp2_equals_none(gpt_text, tmp_path):
    got = run_group(_tp2, 2, str(tmp_path), str(gpt_text), timeout=300)[0]
    _assert_equal_to_1e6(got["selective"], {k: torch.from_numpy(v) for k, v in got["none"].items()})


def test_selective_keeps_less_than_none_and_more_than_full():
    """One training step's peak of live tensor bytes (weights, gradients, activations, temporaries)."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    from ddpkit.models import build_model, model_family
    from ddpkit.parallel.mesh.activation import checkpoint_blocks

    keys = ["model.arch=gpt", "data.dataset=text", "model.n_layer=2", "model.n_embd=64", "model.n_head=4"]
    x = torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_model(load_config(None, keys), 0, 0, 0, vocab_size=64, block_size=64)
        if mode != "none":
            assert checkpoint_blocks(model_family("gpt").checkpointed(model), mode) == 2
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        peaks[mode] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
