"""An optimizer made again over other parameters (what prepare() does for zero1 / zero2 / fsdp / tp) is the same
optimizer: per family, the re-made one takes the same steps as the user's, or one line names what is lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.errors import UserError
from ddpkit.parallel.optimizer import rebuild_optimizer


class ClippedSGD(torch.optim.SGD):
    """A user's own optimizer: an argument of its own (in its defaults, so in each group), the rest passed on."""

    def __init__(self, params, lr=0.1, clip=1.0, **kwargs):
        super().__init__(params, lr=lr, **kwargs)
        self.defaults["clip"] = clip
        for group in self.param_groups:
            group.setdefault("clip", clip)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.clamp_(-group["clip"], group["clip"])
        return super().step(closure)


class ScaledSGD(torch.optim.SGD):
    """A subclass that keeps a setting of its own outside its defaults: made again, it would take scale=1."""

    def __init__(self, params, lr=0.1, scale=1.0):
        super().__init__(params, lr=lr)
        self.scale = scale


def _groups(params):
    return [
        {"params": params[:1], "weight_decay": 0.1},
        {"params": params[1:], "lr": 0.05},
    ]


FAMILIES = {
    "adamw": lambda p: torch.optim.AdamW(_groups(p), lr=0.01, betas=(0.8, 0.95), amsgrad=True),
    "adam-foreach": lambda p: torch.optim.Adam(_groups(p), lr=0.01, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(_groups(p), lr=0.01, fused=True),
    "adam-decoupled": lambda p: torch.optim.Adam(_groups(p), lr=0.01, decoupled_weight_decay=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(_groups(p), lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(
        _groups(p), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1
    ),
    "rmsprop": lambda p: torch.optim.RMSprop(_groups(p), lr=0.01, centered=True, momentum=0.5),
    "user-subclass": lambda p: ClippedSGD(_groups(p), lr=0.2, clip=0.5, momentum=0.9),
}


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 4, generator=g)), nn.Parameter(torch.randn(4, generator=g))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_rebuilt_optimizer_takes_the_users_steps(family):
    mine, theirs = _params(), _params()
    old = FAMILIES[family](mine)
    new = rebuild_optimizer(old, [theirs[:1], theirs[1:]], "ddpkit.prepare(strategy='fsdp')")
    assert type(new) is type(old)
    for a, b in zip(old.param_groups, new.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    for step in range(3):
        for ps, opt in ((mine, old), (theirs, new)):
            g = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b), family
    assert not torch.equal(mine[0], _params()[0])  # the steps moved the weights


@pytest.mark.parametrize(
    ("make", "lost"),
    [
        (lambda p: ScaledSGD(p, lr=0.2, scale=0.5), "ScaledSGD's attribute scale=0.5 cannot be kept"),
        (lambda p: torch.optim.Adam(p, lr=0.01, fused=True, foreach=True), "Adam cannot be made again"),
    ],
)
def test_what_cannot_be_kept_is_named_in_one_line(make, lost):
    try:
        old = make(_params())
    except RuntimeError:  # torch refuses fused with foreach itself: make the optimizer the user could have
        old = torch.optim.Adam(_params(), lr=0.01, fused=True)
        old.defaults["foreach"] = True
    with pytest.raises(UserError) as e:
        rebuild_optimizer(old, [_params()], "ddpkit.prepare(strategy='zero1')")
    assert lost in e.value.line()
    assert e.value.line().startswith("ddpkit.prepare(strategy='zero1'): ")
    assert "\n" not in e.value.line()
