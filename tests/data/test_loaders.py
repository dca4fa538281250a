"""The loaders: distributed_loader gives DistributedSampler's batches, sets the epoch itself (and honours the
tutorials' sampler.set_epoch), seeds its workers per rank and epoch, resumes mid-epoch; eval_loader covers every
sample once and leaves the global random stream alone; build_loaders from a config. Budget: 10 s (no processes
but a loader's workers)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from conftest import data_cfg
from ddpkit.data import (
    DistributedLoader,
    build_datasets,
    build_loaders,
    distributed_loader,
    eval_loader,
)


class _Indexed(Dataset):
    """Item i is (tensor([i]), i % 3)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i % 3


class _Noisy(Dataset):
    """Item i is drawn from torch, numpy and python random: shows how workers are seeded."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor([torch.rand(()).item(), float(np.random.rand()), random.random()])


@pytest.mark.parametrize(
    ("n", "batch", "world", "drop_last"),
    [(200, 16, 2, True), (203, 8, 3, True), (203, 8, 3, False), (10, 4, 4, False)],
)
def test_same_batches_as_torch_distributed_sampler(n, batch, world, drop_last):
    """A script ported from DistributedSampler + DataLoader sees exactly the batches it saw before."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    ds = _Indexed(n)
    for epoch in (0, 3):
        for rank in range(world):
            theirs = DistributedSampler(
                ds, num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=drop_last
            )
            theirs.set_epoch(epoch)
            want = [
                b[0][:, 0].long().tolist() for b in DataLoader(ds, batch, sampler=theirs, drop_last=drop_last)
            ]
            ours = distributed_loader(ds, batch, seed=5, drop_last=drop_last, rank=rank, world_size=world)
            ours.set_epoch(epoch)
            assert [b[0][:, 0].long().tolist() for b in ours] == want, (epoch, rank)


def test_eval_loader_covers_all_once():
    ds = _Indexed(359)
    seen = []
    for r in range(3):
        for x, _ in eval_loader(ds, 50, rank=r, world_size=3):
            seen += x[:, 0].long().tolist()
    assert seen == list(range(359))
    assert len(eval_loader(ds, 50)) == 8  # rank/world default to the (single) process


# ---------------------------------------------------------------- DistributedLoader


def _pass(loader) -> list[int]:
    return [int(v) for x, _ in loader for v in x[:, 0]]


def test_loader_sets_epoch_itself():
    ds = _Indexed(100)
    loader = distributed_loader(ds, 10, seed=1)
    assert isinstance(loader, DistributedLoader) and len(loader) == 10 == loader.micro_batches_per_epoch
    p0, p1 = _pass(loader), _pass(loader)
    assert p0 != p1 and sorted(p0) == sorted(p1) == list(range(100))
    assert loader.epoch == 2
    loader.set_epoch(1)
    assert _pass(loader) == p1
    loader.set_epoch(0)
    assert _pass(loader) == p0
    # mid-epoch resume through the loader: len() and the pass reflect the skip; the next epoch is whole
    loader.set_epoch(1)
    loader.set_start(40)
    assert len(loader) == 6 and _pass(loader) == p1[40:]
    assert loader.epoch == 2 and len(loader) == 10
    # a pass broken early still moves on: the next pass is a new epoch, not a replay of the same order
    for _ in loader:
        break
    assert loader.epoch == 3
    p3 = _pass(loader)
    assert p3 != _pass(loader) and loader.epoch == 5
    # unless the user chose the epoch during the pass (the trainer's way)
    for _ in loader:
        loader.set_epoch(1)
        break
    assert loader.epoch == 1 and _pass(loader) == p1


def test_loader_worker_seeds_per_rank_and_epoch():
    def first_batch(rank, epoch):
        loader = distributed_loader(_Noisy(), 4, seed=3, num_workers=1, rank=rank, world_size=2)
        loader.set_epoch(epoch)
        return next(iter(loader))

    a = first_batch(0, 0)
    assert torch.equal(a, first_batch(0, 0))
    assert not torch.equal(a, first_batch(1, 0))
    assert not torch.equal(a, first_batch(0, 1))
    assert len({float(v) for v in a[:, 1]}) == 4 and len({float(v) for v in a[:, 2]}) == 4


def test_build_loaders_from_config():
    cfg = data_cfg("digits")
    cfg.train.batch_size, cfg.train.grad_accum_steps, cfg.eval.batch_size = 16, 2, 100
    train_ds, val_ds, _ = build_datasets(cfg)
    train, val = build_loaders(cfg, 1, 2, train_ds, val_ds)
    assert train.sampler.world_size == 2 and train.sampler.rank == 1
    assert len(train) == 1438 // 32 // 2 * 2 == 44
    x, y = next(iter(train))
    assert x.shape == (16, 1, 8, 8) and y.shape == (16,)
    assert sum(len(b[1]) for b in val) == 359 - 180 and val.batch_size == 100


def test_set_epoch_on_the_loaders_sampler_is_honoured():
    """What every tutorial writes: `loader.sampler.set_epoch(epoch)` chooses the order (it was ignored)."""
    ds = _Indexed(100)
    reference = distributed_loader(ds, 10, seed=1)
    reference.set_epoch(5)
    want = _pass(reference)
    loader = distributed_loader(ds, 10, seed=1)
    loader.sampler.set_epoch(5)
    assert _pass(loader) == want
    for epoch in range(3):  # the tutorial loop: set_epoch on the sampler before each pass
        loader.sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert _pass(loader) == _pass(reference)


def test_a_resumed_position_survives_the_tutorials_set_epoch_call():
    ds = _Indexed(100)
    loader = distributed_loader(ds, 10, seed=2)
    loader.set_epoch(3)
    full = _pass(loader)
    it = iter(loader)
    loader.set_epoch(3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it
    assert state == {"epoch": 3, "consumed": 40}
    resumed = distributed_loader(ds, 10, seed=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(3)  # the script's own set_epoch(epoch) at the top of the resumed epoch
    assert _pass(resumed) == full[40:]
    resumed.set_epoch(3)  # asked again after the pass: the whole epoch
    assert _pass(resumed) == full


def test_an_evaluation_pass_leaves_the_global_random_stream_alone():
    loader = eval_loader(_Indexed(20), 4)
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(3), want)
