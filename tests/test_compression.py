"""Gradient compression through torch's DDP communication hooks, on real gloo processes: each setting trains, and
PowerSGD's state survives a checkpoint round trip to the same weights as an unbroken run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.config import load_config
from ddpkit.distributed.compression import Compression
from ddpkit.distributed.runtime import current
from ddpkit.distributed.strategy import build_strategy
from ddpkit.errors import UserError


def _batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _run(kind: str, steps: int, resume_at: int | None = None) -> dict[str, torch.Tensor]:
    """`steps` optimizer steps with compression `kind`; with resume_at, the model, optimizer and hook state are
    saved there and loaded into a fresh DDP module, which does the rest."""
    ctx = current()
    rank = ddpkit.get_rank()
    batches = _batches(steps, seed=rank)

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        strategy = build_strategy(
            "ddp", ctx, compression=Compression(kind, powersgd_rank=2, powersgd_warmup_steps=2)
        )
        ddp = strategy.wrap(model)
        return model, ddp, strategy, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    model, ddp, strategy, opt = fresh()
    for i, (x, y) in enumerate(batches):
        if i == resume_at:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": strategy.hook_state()}
            saved = torch.load(_roundtrip(saved), weights_only=True)  # what a checkpoint file gives back
            model, ddp, strategy, opt = fresh()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            strategy.load_hook_state(saved["hook"])
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _close(a: dict, b: dict, tol: float) -> bool:
    return all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in a)


@pytest.mark.slow
def test_each_compression_trains_close_to_the_exact_all_reduce():
    exact = ddpkit.launch(_run, "none", 12, nprocs=2)[0]
    for kind, tol in (("fp16", 1e-3), ("bf16", 1e-2)):
        r0, r1 = ddpkit.launch(_run, kind, 12, nprocs=2)
        assert _close(r0, r1, 0) and _close(r0, exact, tol) and not _close(r0, exact, 0), kind
    r0, r1 = ddpkit.launch(_run, "powersgd", 12, nprocs=2)
    assert _close(r0, r1, 0)  # every replica applies the same (approximate) gradient
    assert not _close(r0, exact, 1e-4)  # rank 2 of a 64x32 gradient: really compressed


@pytest.mark.slow
def test_powersgd_state_survives_a_checkpoint_to_the_unbroken_weights():
    unbroken = ddpkit.launch(_run, "powersgd", 10, nprocs=2)[0]
    resumed = ddpkit.launch(_run, "powersgd", 10, 6, nprocs=2)[0]  # past the warm-up: error feedback in play
    assert _close(unbroken, resumed, 0)


def test_no_hook_state_without_powersgd():
    assert Compression("fp16").state_dict(None) is None


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["dist.strategy=fsdp", "dist.grad_compression=fp16"], "dist.grad_compression=fp16 is a DDP setting"),
        (["dist.strategy=single", "dist.bucket_cap_mb=5"], "dist.strategy=single has no DDP wrapper"),
        (["dist.strategy=dp", "dist.static_graph=true"], "dist.static_graph=True"),
        (["dist.powersgd_warmup_steps=1"], "dist.powersgd_warmup_steps must be >= 2"),
        (["dist.grad_compression=int8"], "dist.grad_compression must be one of"),
    ],
)
def test_settings_a_strategy_cannot_use_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(UserError) as e:
        load_config(None, overrides)
    assert fragment in e.value.line(), e.value.line()
