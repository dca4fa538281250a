"""The user's sampler stays the user's: prepare() keeps a DataLoader's generator= (and its seed), so a ported
one-process script repeats its unported self bit for bit with shuffle on, across epochs, with workers, and through
a mid-epoch save_state / load_state; with N processes `split_batches=True` gives the ranks together the batches of
the one-process script, in its order, and refuses ranks that would draw different orders or a batch N does not
divide."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ddpkit
from conftest import run_group
from ddpkit.errors import UserError


class Noisy(Dataset):
    """Item i: (i with a random jitter, i % 4): the jitter draws from torch's stream (a worker's own in workers)."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int):
        return torch.tensor([float(i), float(i) % 3]) + 0.01 * torch.randn(2), i % 4


def _script(port: bool, workers: int = 0, stop_after: int | None = None, state=None, save=None):
    """A one-process training script: a seeded generator= for the shuffle, dropout in the model; `port`: the same
    script through ddpkit.prepare. Returns every loss and the final weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234)
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, generator=gen, num_workers=workers)
    if port:
        model, opt, loader = ddpkit.prepare(model, opt, loader)
    start = 0
    if state is not None:
        start = ddpkit.load_state(state, model=model, optimizer=opt, loader=loader)["epoch"]
    losses, steps = [], 0
    for epoch in range(start, 2):  # after a resume, the rest of the epoch it stopped in first
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x / 37), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            steps += 1
            if steps == stop_after:
                ddpkit.save_state(save, model=model, optimizer=opt, loader=loader, epoch=epoch)
                return losses, None
    return losses, [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_ported_one_process_script_with_a_seeded_generator_repeats_itself_bit_for_bit(workers):
    unported, ported = _script(False, workers), _script(True, workers)
    assert len(unported[0]) == 20  # 10 batches an epoch, 2 epochs
    assert _same(unported, ported)  # every loss and every weight, bit for bit


def test_a_seeded_generator_resumes_mid_epoch_to_the_unbroken_run(tmp_path):
    whole = _script(True)
    first, _ = _script(True, stop_after=13, save=tmp_path / "s.pt")  # 3 batches into the second epoch
    rest = _script(True, state=tmp_path / "s.pt")  # a fresh process's objects, the generator seeded anew
    assert first + rest[0] == whole[0]
    assert all(torch.equal(p, q) for p, q in zip(rest[1], whole[1], strict=True))


def _split_batches(rank: int, world_size: int) -> dict:
    data = TensorDataset(torch.arange(24).float().unsqueeze(1))

    def loader(batch: int = 8, seed: int = 7):
        return DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))

    def train(port: bool) -> tuple[list[float], list[list[float]]]:
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        batches = loader()
        if port:
            model, opt, batches = ddpkit.prepare(model, opt, batches, split_batches=True)
            assert batches.batch_size == 4  # each rank half of the script's batch of 8
        losses, seen = [], []
        for _ in range(2):
            for (x,) in batches:
                loss = ((model(x / 24) - x / 24) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                samples = x.flatten().tolist()
                losses.append(float(ddpkit.all_reduce_mean(loss.detach())) if port else loss.item())
                seen.append(sorted(ddpkit.gather(samples) if port else samples))
        return losses, seen

    out = {"one": train(port=False), "ported": train(port=True), "refused": []}
    for make in (lambda: loader(seed=rank), lambda: loader(batch=7)):  # seeded per rank; 7 over 2 ranks
        try:
            next(iter(ddpkit.prepare(make(), split_batches=True)))
        except UserError as e:
            out["refused"].append(str(e))
    return out


@pytest.mark.slow
def test_split_batches_gives_n_processes_the_one_process_batches_in_its_order():
    r0, r1 = run_group(_split_batches, 2)
    (one_losses, one_seen), (losses, seen) = r0["one"], r0["ported"]
    assert seen == one_seen  # at every step the samples of the one-process step, over both epochs
    assert losses == pytest.approx(one_losses, rel=1e-6)
    assert r1["ported"][0] == losses
    differ, indivisible = r0["refused"]
    assert "the ranks drew different orders for a training loader" in differ
    assert "cuts each batch of 7 samples over 2 data-parallel ranks" in indivisible
