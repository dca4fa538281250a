"""A user's own small transformer and a training script driven through ddpkit.prepare(pp=...), importable by the
spawned processes of tests/parallel/test_pipeline.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

STEPS, BATCH, VOCAB, T = 6, 8, 13, 8


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(self.norm(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (n, T + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def model_and_data():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    train = DataLoader(tokens(BATCH * STEPS, 1), batch_size=BATCH, shuffle=True, drop_last=True)
    val = DataLoader(tokens(20, 2), batch_size=6, shuffle=False)
    return model, opt, train, val


def single() -> dict:
    """The unported one-process run: a plain DataLoader's own random order (one pipeline replica keeps it)."""
    model, opt, train, val = model_and_data()
    model, opt, val = ddpkit.prepare(model, opt, val)
    losses = []
    for x, y in train:
        loss = lm_loss(model(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        n = sum(len(y) for _, y in val)
        val_loss = sum(float(lm_loss(model(x), y)) * len(y) for x, y in val) / n
    return {
        "state": {k: v.numpy() for k, v in model.state_dict().items()},
        "val_loss": val_loss,
        "losses": losses,
    }


def piped(pp: int, schedule: str, split: tuple[str, ...] = ("blocks.2",)) -> dict:
    """The same training through prepare(pp=...): the per-step calls docs/pipeline.md shows."""
    model, opt, train, val = model_and_data()
    world = ddpkit.get_world_size()
    train = DataLoader(train.dataset, batch_size=BATCH * pp // world, shuffle=True, drop_last=True)
    model, opt, train, val = ddpkit.prepare(
        model, opt, train, val, pp=pp, pp_split=list(split), loss_fn=lm_loss, pp_schedule=schedule
    )
    losses = []
    for x, y in train:
        losses.append(float(model.step(x, y)))
        ddpkit.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    state = model.full_state()
    assert model.eval() is model and not model.training  # as nn.Module's, before the validation
    modes = {"eval": _modes(model)}
    val_loss = model.evaluate(val)
    modes["evaluated"] = _modes(model)  # evaluate() leaves the mode it was given
    model.train()
    modes["train"] = _modes(model)
    return {
        "state": {k: v.numpy() for k, v in state.items()} if state is not None else None,
        "val_loss": val_loss,
        "losses": losses,
        "modes": modes,
    }


def _modes(model) -> list[bool]:
    """The training flag of every module of the user's model and of the stages this rank runs."""
    return [m.training for top in (model.model, *model.runner.stages) for m in top.modules()]


# ---- a small convolutional net computing in channels_last (no BatchNorm: micro-batches leave the math alone)


def conv_model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    ).to(memory_format=torch.channels_last)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(BATCH * STEPS + 20, 3, 8, 8, generator=g),
        torch.randint(0, 5, (BATCH * STEPS + 20,), generator=g),
    )
    train = TensorDataset(x[: BATCH * STEPS], y[: BATCH * STEPS])
    val = DataLoader(TensorDataset(x[BATCH * STEPS :], y[BATCH * STEPS :]), batch_size=6, shuffle=False)
    return model, opt, train, val


def conv_single() -> dict:
    model, opt, train, val = conv_model_and_data()
    train = DataLoader(train, BATCH, shuffle=True, drop_last=True)  # the unported order, which pp keeps
    for x, y in train:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        n = sum(len(y) for _, y in val)
        val_loss = sum(float(F.cross_entropy(model(x), y)) * len(y) for x, y in val) / n
    return {"state": {k: v.contiguous().numpy() for k, v in model.state_dict().items()}, "val_loss": val_loss}


def conv_piped(pp: int) -> dict:
    model, opt, train, val = conv_model_and_data()
    train = DataLoader(train, batch_size=BATCH * pp // ddpkit.get_world_size(), shuffle=True, drop_last=True)
    model, opt, train, val = ddpkit.prepare(
        model, opt, train, val, pp=pp, pp_split=["2"], loss_fn=F.cross_entropy
    )
    for x, y in train:
        model.step(x, y)
        opt.step()
        opt.zero_grad()
    state = model.full_state()
    return {
        "state": {k: v.contiguous().numpy() for k, v in state.items()} if state is not None else None,
        "val_loss": model.evaluate(val),
    }
