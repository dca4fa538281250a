"""Optimizer, linear lr scaling and schedules (ddpkit.train.optim)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from ddpkit.config import Config
from ddpkit.train.optim import (
    build_optimizer,
    build_scheduler,
    global_batch_size,
    lr_factor,
    scaled_lr,
    total_steps,
    warmup_steps,
)


def make_cfg(**optim) -> Config:
    cfg = Config()
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    return cfg


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def lrs(cfg: Config, base: float, steps_per_epoch: int, total: int, n: int | None = None) -> list[float]:
    """The lr used by each optimizer step 0..n-1."""
    opt = build_optimizer(tiny(), cfg, base)
    sched = build_scheduler(opt, cfg, steps_per_epoch, total)
    out = []
    for _ in range(total if n is None else n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# ------------------------------------------------------------------------------------------ batch and lr


def test_global_batch_size():
    assert global_batch_size(256, 4, 1) == 1024
    assert global_batch_size(128, 8, 2) == 2048
    assert global_batch_size(32, 1, 1) == 32


def test_total_steps_is_capped_by_max_steps():
    assert total_steps(10, 44) == 440
    assert total_steps(10, 44, max_steps=50) == 50 and total_steps(1, 44, max_steps=500) == 44


def test_scaled_lr_linear_rule():
    assert scaled_lr(0.1, 512, 256) == pytest.approx(0.2)
    assert scaled_lr(0.1, 256, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 64, 256) == pytest.approx(0.025)
    assert scaled_lr(0.1, 4096, None) == 0.1  # scaling off


def test_scaled_lr_scenarios():
    # A.6 (Distribuuuu): lr = 0.1 x batch / 128; batch 1024 -> 0.8, batch 8192 -> 6.4 (its OPTIM.BASE_LR 6.4).
    assert scaled_lr(0.1, 1024, 128) == pytest.approx(0.8)
    assert scaled_lr(0.1, global_batch_size(128, 64, 1), 128) == pytest.approx(6.4)
    # A.3: the same per-process batch on 2 GPUs doubles the lr.
    assert scaled_lr(0.01, global_batch_size(256, 2, 1), 256) == pytest.approx(0.02)
    # Gradient accumulation counts like more processes.
    assert scaled_lr(0.1, global_batch_size(128, 2, 2), 256) == pytest.approx(0.2)


# ------------------------------------------------------------------------------------------ optimizers


def test_sgd_settings():
    model = tiny()
    opt = build_optimizer(model, make_cfg(name="sgd", momentum=0.9, nesterov=True, weight_decay=1e-4), 0.01)
    assert type(opt) is torch.optim.SGD
    (g,) = opt.param_groups
    assert g["lr"] == 0.01 and g["momentum"] == 0.9 and g["nesterov"] is True and g["weight_decay"] == 1e-4
    # Documented choice: one group, every parameter decayed (biases and norm weights too), as in the tutorials.
    assert len(g["params"]) == len(list(model.parameters()))


def test_sgd_no_nesterov_without_momentum():
    opt = build_optimizer(tiny(), make_cfg(name="sgd", momentum=0.0, nesterov=True), 0.1)
    assert opt.param_groups[0]["nesterov"] is False and opt.param_groups[0]["momentum"] == 0.0


def test_adamw_settings():
    opt = build_optimizer(tiny(), make_cfg(name="adamw", weight_decay=0.05), 1e-3)
    assert type(opt) is torch.optim.AdamW
    g = opt.param_groups[0]
    assert g["lr"] == 1e-3 and g["weight_decay"] == 0.05 and g["betas"] == (0.9, 0.999)


def test_frozen_parameters_left_out():
    model = tiny()
    model[0].weight.requires_grad_(False)
    opt = build_optimizer(model, make_cfg(), 0.1)
    assert all(p is not model[0].weight for p in opt.param_groups[0]["params"])


def test_sgd_steps_like_the_tutorial_script():
    # Scenario A.1: SGD lr 0.01, momentum 0.9, weight decay 1e-4, Nesterov, over model.parameters().
    cfg = make_cfg(name="sgd", momentum=0.9, nesterov=True, weight_decay=1e-4)
    a, b = tiny(), tiny()
    ours = build_optimizer(a, cfg, 0.01)
    theirs = torch.optim.SGD(b.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, nesterov=True)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for model, opt in ((a, ours), (b, theirs)):
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


# ------------------------------------------------------------------------------------------ schedules


def test_warmup_steps_rounding():
    assert warmup_steps(make_cfg(warmup_epochs=0), 10) == 0
    assert warmup_steps(make_cfg(warmup_epochs=2), 10) == 20
    assert warmup_steps(make_cfg(warmup_epochs=0.3), 10) == 3
    assert warmup_steps(make_cfg(warmup_epochs=0.01), 10) == 1  # asked for warmup: at least one step


def test_warmup_then_cosine():
    cfg = make_cfg(schedule="cosine", warmup_epochs=2)
    seq = lrs(cfg, 0.4, steps_per_epoch=10, total=100)
    assert seq[0] == pytest.approx(0.4 / 20)  # step 0: lr / warmup_steps
    assert seq[9] == pytest.approx(0.4 * 10 / 20)
    assert seq[19] == pytest.approx(0.4)  # the last warmup step reaches the full lr
    assert seq[20] == pytest.approx(0.4)  # cosine starts from the top
    assert seq[60] == pytest.approx(0.2)  # halfway through the cosine part
    assert all(x > y for x, y in zip(seq[20:], seq[21:], strict=False))
    assert seq[-1] < 0.4 * 1e-3  # last step: almost 0
    assert lr_factor(100, schedule="cosine", total_steps=100, steps_per_epoch=10, warmup=20) == pytest.approx(
        0
    )
    assert lr_factor(150, schedule="cosine", total_steps=100, steps_per_epoch=10, warmup=20) == pytest.approx(
        0
    )


def test_cosine_without_warmup():
    seq = lrs(make_cfg(schedule="cosine", warmup_epochs=0), 0.1, steps_per_epoch=5, total=50)
    assert seq[0] == pytest.approx(0.1)
    assert seq[25] == pytest.approx(0.05)
    assert seq[-1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 49 / 50)))


def test_step_decay_at_epoch_boundaries():
    cfg = make_cfg(schedule="step", step_size=2, step_gamma=0.1, warmup_epochs=0)
    seq = lrs(cfg, 1.0, steps_per_epoch=4, total=24)
    assert seq[:8] == pytest.approx([1.0] * 8)  # epochs 0-1
    assert seq[8:16] == pytest.approx([0.1] * 8)  # epochs 2-3
    assert seq[16:24] == pytest.approx([0.01] * 8)  # epochs 4-5


def test_step_decay_with_warmup():
    cfg = make_cfg(schedule="step", step_size=3, step_gamma=0.5, warmup_epochs=1)
    seq = lrs(cfg, 1.0, steps_per_epoch=4, total=16)
    assert seq[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert seq[4:12] == pytest.approx([1.0] * 8)
    assert seq[12:16] == pytest.approx([0.5] * 4)


def test_constant_stays():
    assert lrs(make_cfg(schedule="constant", warmup_epochs=0), 0.3, 7, 40) == pytest.approx([0.3] * 40)
    warm = lrs(make_cfg(schedule="constant", warmup_epochs=1), 0.3, 2, 10)
    assert warm == pytest.approx([0.15] + [0.3] * 9)


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_scheduler_state_dict_round_trip(schedule):
    cfg = make_cfg(schedule=schedule, warmup_epochs=1, step_size=1, step_gamma=0.5)
    spe, total, cut = 5, 30, 8
    reference = lrs(cfg, 0.2, spe, total)

    opt = build_optimizer(tiny(), cfg, 0.2)
    sched = build_scheduler(opt, cfg, spe, total)
    for _ in range(cut):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # checkpoints are read with weights_only=True

    opt2 = build_optimizer(tiny(), cfg, 0.2)
    sched2 = build_scheduler(opt2, cfg, spe, total)
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["scheduler"])
    resumed = []
    for _ in range(total - cut):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(reference[cut:])
    assert sched2.last_epoch == total
