"""Routed experts and expert parallelism: a mixture-of-experts Llama (model.arch=llama model.n_experts=4, top-2, a
shared expert, the auxiliary loss; gradients clipped to a norm the steps exceed) ends with the weights of one
process under every layout of dist.ep on real gloo processes, its routing metrics equal too, and its sharded
checkpoints load into other layouts.

- 4 ranks (the reused pool, the Trainer in-process): ep2 x fsdp (dp 4: the experts FSDP2-sharded over 2 edp
  ranks), ep2 x hsdp (2 x 2), ep2 x tp2 (zero2), ep2 x pp2 (ddp) stopping at step 2 with a sharded checkpoint;
- 2 ranks: that checkpoint continued under ep2 alone (ep x pp -> ep), ep2 under ddp (its metrics and `ddpkit
  report`), ep2 x fsdp with DeepSeek-V3's bias balancing, sigmoid scores, a dense block between MoE blocks,
  gradient accumulation and activation checkpointing (its own reference), stopping at step 2 with a sharded
  checkpoint that one process continues (ep2 -> one process);
- in-process: the routing against a token-by-token sum, the grouped matmul against the loop, the all-to-all's
  order, the auxiliary loss's value and gradient, counting under activation checkpointing, FLOPs of the active
  experts, and the one-line refusals of layouts that cannot be.

Time budget: about 100 s on a quiet 2-core machine (two one-process references here, a 4-rank group of four
3-step runs, a 2-rank group of three runs, a one-process resume).
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_RUN, cli_in_process, dist_context, metrics_rows, plain, run_group, train_here
from ddpkit.checkpoint import CheckpointDir, load_checkpoint
from ddpkit.checkpoint.sharded import read_model
from ddpkit.config import load_config
from ddpkit.errors import UserError
from ddpkit.models import model_family
from ddpkit.parallel.plan import check_config

MOE = [
    *(o for o in GPT_RUN if not o.startswith("model.arch")),
    "model.arch=llama",
    "model.n_experts=4",
    "model.experts_per_token=2",
    "model.n_shared_experts=1",
    "model.moe_ffn_hidden=24",
    "train.clip_grad_norm=0.2",
]
# the bias balancing (a rate that moves the routing within 3 steps), sigmoid scores, block 0 dense and block 1 of
# experts, 2 accumulated micro-batches (16 samples a step), activation checkpointing
BIAS = [
    "model.moe_balance=bias",
    "model.moe_bias_rate=0.05",
    "model.moe_score=sigmoid",
    "model.moe_every=2",
    "model.n_shared_experts=0",
    "train.grad_accum_steps=2",
    "model.activation_checkpointing=full",
]
ROUTING = ("moe_aux_loss", "moe_balance_max", "moe_balance_mean")


def _weights(out) -> dict[str, torch.Tensor]:
    newest = CheckpointDir(out).candidates()[0]
    return read_model(newest) if newest.is_dir() else load_checkpoint(newest)["model"]


def _assert_close(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        torch.testing.assert_close(torch.as_tensor(got[k]), ref[k], rtol=1e-4, atol=1e-6, msg=k)


def _reference(root, text, *settings: str) -> tuple[dict, dict, object]:
    out = root / "run"
    train_here(
        *MOE, f"out_dir={out}", f"data.root={text}", "train.batch_size=8", "train.max_steps=3", *settings
    )
    return _weights(out), metrics_rows(out)[-1], out


@pytest.fixture(scope="module")
def reference(gpt_text, tmp_path_factory):
    """The one-process run of MOE, 3 SGD steps of 8 samples: (weights, last metrics line, out_dir)."""
    return _reference(tmp_path_factory.mktemp("moe_reference"), gpt_text)


@pytest.fixture(scope="module")
def deep_reference(gpt_text, tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("moe_deep_reference"), gpt_text, "model.n_layer=4")


@pytest.fixture(scope="module")
def bias_reference(gpt_text, tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("moe_bias_reference"), gpt_text, *BIAS)


# ------------------------------------------------------------------------------------- in-process checks


def _cfg(*overrides: str):
    return load_config(None, [*MOE, "train.batch_size=2", *overrides])


def test_llama_with_experts_is_the_mixtral_family_and_counts_the_flops_of_its_active_experts():
    from ddpkit.models.flops import decoder_flops, model_flops
    from ddpkit.models.mixtral.model import Mixtral

    cfg = _cfg()
    family = model_family("llama", cfg.model)
    assert family.name == "mixtral" and family.routed_experts(cfg.model) == 4
    assert model_family("llama").name == "llama"  # without the config: the name's owner
    model = family.build_lm("llama", 50, 16, cfg.model)
    assert isinstance(model, Mixtral)
    spec = type("Spec", (), {"tokens": True, "vocab_size": 50, "block_size": 16})()
    every = decoder_flops(model, 16)  # as if each token went through all 4 experts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert model_flops(cfg, spec) == every - 6 * experts // 2  # 2 of 4 experts active


def _moe(**routing):
    from ddpkit.models.experts import MoE, Routing, init_experts
    from ddpkit.models.llama.model import SwiGLU

    torch.manual_seed(0)
    shared = SwiGLU(8, 12)
    moe = MoE(8, 12, Routing(n_experts=4, top_k=2, **routing), shared)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    init_experts(moe.experts, 0.3, 0.3)
    return moe


def test_routing_is_each_tokens_chosen_experts_weighted_and_summed():
    import torch.nn.functional as F

    moe = _moe(aux_weight=0.0).eval()
    x = torch.randn(3, 5, 8)
    h = x.reshape(-1, 8)
    scores = F.linear(h, moe.router.weight).softmax(-1)
    top = scores.topk(2, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    e = moe.experts
    want = torch.stack(
        [
            sum(
                w * ((F.silu(t @ e.gate[k].T) * (t @ e.up[k].T)) @ e.down[k].T)
                for w, k in zip(weights[i], top.indices[i].tolist(), strict=True)
            )
            + moe.shared(t)
            for i, t in enumerate(h)
        ]
    )
    torch.testing.assert_close(moe(x).reshape(-1, 8), want, rtol=1e-5, atol=1e-6)


def test_the_grouped_matmul_computes_what_the_loop_does_even_with_experts_or_ranks_without_tokens(
    monkeypatch,
):
    from ddpkit.models import experts

    gate, up = (torch.randn(4, 8, 16, requires_grad=True) for _ in range(2))
    down = torch.randn(4, 16, 8, requires_grad=True)
    for counts in ([3, 0, 5, 2], [0, 0, 0, 0]):
        n = sum(counts)
        x = torch.randn(n, 16, requires_grad=True)
        got = []
        for way in ("loop", "grouped"):
            monkeypatch.setitem(experts.FASTER, "cpu", way)
            assert experts.grouped_here(x, gate, up, down) == (way == "grouped")
            y = experts.swiglu_experts(x, torch.tensor(counts), gate, up, down)
            assert (
                y.grad_fn is not None
            )  # no rows still hangs on x: the all-to-all's backward runs everywhere
            grads = torch.autograd.grad(y.square().sum(), (x, gate, down), allow_unused=False)
            got.append((y.detach(), grads))
        torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)


def test_the_tokens_a_rank_receives_are_put_in_expert_major_order():
    from ddpkit.parallel.experts.dispatch import expert_major, inverse

    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # from rank 0: 2 rows for expert 0, 1 for expert 2; ...
    rows = torch.tensor([0, 0, 2, 10, 11, 11, 11])  # rank-major, each row named by (rank * 10 + expert)
    order = expert_major(counts)
    assert rows[order].tolist() == [0, 0, 10, 11, 11, 11, 2]
    assert rows[order][inverse(order)].tolist() == rows.tolist()


def test_the_auxiliary_loss_is_one_when_balanced_and_joins_the_backward_as_if_added_to_the_loss():
    moe = _moe(aux_weight=0.5, n_moe_blocks=2).train()
    scores = torch.full((2, 4, 4), 0.25)
    chosen = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).expand(2, 4, 2)
    assert moe._aux(scores, chosen).item() == pytest.approx(1.0)
    x = torch.randn(2, 6, 8)
    moe.aux_scale = 0.25  # the loss's own scale (1 / 4 accumulated micro-batches, say)
    joined = torch.autograd.grad(moe(x).sum() * 0.25, moe.router.weight)[0]
    moe.routing = type(moe.routing)(**{**moe.routing.__dict__, "aux_weight": 0.0})
    moe.router.routing = moe.routing
    out = moe(x)
    b, t = x.shape[:2]
    scores, chosen, _ = moe.router(x.reshape(-1, 8))
    aux = moe._aux(scores.view(b, t, -1), chosen.view(b, t, -1))
    added = torch.autograd.grad((out.sum() + 0.5 / 2 * aux) * 0.25, moe.router.weight)[0]
    torch.testing.assert_close(joined, added)


def test_a_block_recomputed_by_activation_checkpointing_counts_its_tokens_once():
    from torch.utils.checkpoint import checkpoint

    moe = _moe(aux_weight=0.01).train()
    x = torch.randn(2, 6, 8, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert (
        moe.load.sum().item() == 2 * 6 * 2 and moe.aux_sums[1].item() == 2
    )  # 12 tokens x 2 experts, 2 sequences


REFUSED = {
    ("model.n_experts=null", "dist.ep=2"): "dist.ep=2 splits a mixture of experts' routed experts",
    ("model.n_experts=6", "dist.ep=4"): "model.n_experts=6 cannot be split over dist.ep=4 ranks",
    ("dist.ep=3",): "dist.ep=3 does not divide the 4 data-parallel rank(s)",
    ("dist.ep=2", "dist.strategy=zero1"): "dist.strategy=zero1 cannot run with expert parallelism",
    ("dist.ep=4", "dist.strategy=hsdp", "dist.dp_shard=2"): "dist.ep=4 does not divide HSDP's sharding group",
    ("dist.ep=2", "dist.tp=4"): "dist.ep=2 does not divide the 1 data-parallel rank(s)",
}


@pytest.mark.parametrize("settings", list(REFUSED))
def test_a_layout_that_cannot_be_is_one_line_naming_the_key_before_workers_start(settings):
    with pytest.raises(UserError) as e:
        check_config(_cfg(*settings), 4, per_node=4)
    assert REFUSED[settings] in e.value.line()


def test_expert_keys_that_do_not_fit_are_refused():
    from ddpkit.models import check_arch

    for settings, said in (
        (("model.arch=gpt",), "model.n_experts=4: model.arch=gpt has no routed experts"),
        (("model.experts_per_token=5",), "model.experts_per_token=5 is more than the model.n_experts=4"),
        (("model.moe_every=3",), "model.moe_every=3 leaves the model.n_layer=2 blocks without experts"),
        (("model.arch=mixtral", "model.n_experts=0"), "model.arch=mixtral is a mixture of experts"),
    ):
        with pytest.raises(UserError, match=said):
            check_arch(_cfg(*settings))
    layout = check_config(_cfg("dist.ep=2", "dist.tp=2", "dist.pp=2", "dist.strategy=fsdp"), 8, per_node=8)
    assert (layout.dp, layout.ep, layout.coords(5)["ep"], layout.coords(5)["edp"]) == (2, 2, 0, 0)
    assert layout.describe(3) == "dp_replicate=0 dp_shard=1 dp=1 tp=1 pp=0 ep=1"


# ---------------------------------------------------------------------------- multi-process: every layout


def _fit(rank: int, world_size: int, *settings: str) -> dict:
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    cfg = load_config(None, [*MOE, *settings])
    with Heartbeat(rank, world_size) as heartbeat:
        trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
        trainer.fit()
        return plain(trainer.strategy.model_state(trainer.wrapped))


FOUR = {  # 2 samples per data-parallel rank and step: 8 per step
    "ep2-fsdp": ("dist.ep=2", "dist.strategy=fsdp", "train.batch_size=2"),
    "ep2-hsdp": ("dist.ep=2", "dist.strategy=hsdp", "dist.dp_shard=2", "train.batch_size=2"),
    "ep2-tp2": ("dist.ep=2", "dist.tp=2", "train.batch_size=4"),
    "ep2-pp2": ("dist.ep=2", "dist.pp=2", "train.batch_size=4", "checkpoint.format=sharded"),
    # a zero-bubble schedule (two stages a rank, so 4 blocks): the replicas average after the step, not the experts
    "ep2-zbv": ("dist.ep=2", "dist.pp=2", "dist.pp_schedule=zbv", "train.batch_size=4", "model.n_layer=4"),
}


def _four(rank: int, world_size: int, root: str, text: str) -> dict:
    weights = {}
    for name, settings in FOUR.items():
        steps = "train.max_steps=2" if name == "ep2-pp2" else "train.max_steps=3"
        weights[name] = _fit(
            rank, world_size, f"out_dir={root}/{name}", f"data.root={text}", steps, *settings
        )
    return weights


def _two(rank: int, world_size: int, root: str, text: str) -> dict:
    run = (f"data.root={text}", "dist.ep=2")
    return {  # the pipeline's checkpoint continued under ep alone; ep2; ep2 x fsdp with BIAS, to step 2
        "ep2-pp2": _fit(rank, world_size, f"out_dir={root}/ep2-pp2", "train.max_steps=3", *run, "train.batch_size=4"),
        "ep2": _fit(rank, world_size, f"out_dir={root}/ep2", "train.max_steps=3", *run, "train.batch_size=4"),
        "bias": _fit(
            rank, world_size, f"out_dir={root}/bias", "train.max_steps=2", *run, "dist.strategy=fsdp",
            "checkpoint.format=sharded", *BIAS, "train.batch_size=4",
        ),
    }  # fmt: skip


def _eight(rank: int, world_size: int, root: str, text: str) -> dict:
    # fsdp over dp=4 (ep=2 of them) x pp=2: 2 samples per data-parallel rank and step, 8 per step, 2 micro-batches
    settings = (
        "dist.ep=2",
        "dist.pp=2",
        "dist.strategy=fsdp",
        "dist.pp_microbatches=2",
        "train.batch_size=2",
    )
    return _fit(
        rank, world_size, f"out_dir={root}/ep2-pp2-fsdp", f"data.root={text}", "train.max_steps=3", *settings
    )


@pytest.mark.slow
def test_ep2_x_pp2_x_fsdp_on_8_processes_equals_one_process(reference, gpt_text, tmp_path):
    """docs/parallelism.md's 8-process line: the experts split over ep inside fsdp's data-parallel ranks, the
    blocks over two pipeline stages."""
    _assert_close(
        run_group(_eight, 8, str(tmp_path), str(gpt_text), timeout=400, fresh=True)[0], reference[0]
    )


@pytest.mark.slow
def test_every_layout_of_ep_equals_one_process_and_its_checkpoints_load_into_other_layouts(
    reference, deep_reference, bias_reference, gpt_text, tmp_path, capsys
):
    four = run_group(_four, 4, str(tmp_path), str(gpt_text), timeout=400)[0]  # full weights on rank 0
    for name in ("ep2-fsdp", "ep2-hsdp", "ep2-tp2"):
        _assert_close(four[name], reference[0])
    _assert_close(four["ep2-zbv"], deep_reference[0])
    for name in ("ep2-fsdp", "ep2-tp2"):  # the routing's metrics: every rank's tokens, each counted once
        row = metrics_rows(tmp_path / name)[-1]
        for key in ROUTING:
            assert row[key] == pytest.approx(reference[1][key], rel=1e-4), (name, key)
    assert sorted(p.name for p in (tmp_path / "ep2-pp2/checkpoints/last.dcp").glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(4)
    ]
    two = run_group(_two, 2, str(tmp_path), str(gpt_text), timeout=300)[0]
    _assert_close(two["ep2-pp2"], reference[0])  # ep x pp's shards read into ep alone, continued to step 3
    _assert_close(two["ep2"], reference[0])
    row = metrics_rows(tmp_path / "ep2")[-1]
    assert all(row[k] == pytest.approx(reference[1][k], rel=1e-4) for k in ROUTING)
    assert row["moe_balance_max"] >= row["moe_balance_mean"] >= 1.0 and reference[1]["moe_aux_loss"] > 0.9
    # BIAS under ep2 x fsdp, its sharded checkpoint of step 2 continued on one process (ep2 -> 1)
    out = tmp_path / "bias"
    train_here(
        *MOE, *BIAS, f"out_dir={out}", f"data.root={gpt_text}", "train.batch_size=8", "train.max_steps=3"
    )
    weights = _weights(out)
    assert "blocks.1.mlp.router.expert_bias" in weights and "blocks.0.mlp.router.weight" not in weights
    # the bias of every step moved the same, over every rank's tokens
    _assert_close(weights, bias_reference[0])
    assert (weights["blocks.1.mlp.router.expert_bias"].abs() == 0.05).all()  # three steps of +-0.05 each
    # ddpkit report shows the routing of a mixture of experts
    proc = cli_in_process(
        capsys, "report", str(tmp_path / "ep2"), str(reference[2]), "--out", str(tmp_path / "r.png")
    )
    assert proc.returncode == 0, proc.stderr
    assert "| MoE aux loss | MoE load max / mean |" in proc.stdout
    assert f"{reference[1]['moe_balance_max']:.3f} / {reference[1]['moe_balance_mean']:.3f}" in proc.stdout
