"""TensorImageDataset's batched fetch (__getitems__, which DataLoader calls with a whole batch of indices) gives
the images its per-sample path gives, from the same random stream. Budget: 2 s (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from ddpkit.data.loaders import eval_loader
from ddpkit.data.tensor_sets import SyntheticImages, TensorImageDataset, collate


@pytest.mark.parametrize(
    "shift, flip, size", [(0, False, None), (0, True, None), (1, False, None), (1, True, None), (2, True, 12)]
)
def test_a_batch_at_once_equals_sample_by_sample_from_the_same_seed(shift, flip, size):
    images, labels = torch.rand(50, 3, 8, 8), torch.randint(10, (50,))
    ds = TensorImageDataset(images, labels, 0.3, 0.2, shift=shift, flip=flip, size=size)
    order = [3, 1, 4, 1, 5, 9, 2, 6, 49, 0]
    torch.manual_seed(5)
    one_by_one = default_collate([ds[i] for i in order])
    torch.manual_seed(5)
    batched = collate(ds.__getitems__(order))
    assert torch.equal(one_by_one[0], batched[0]) and torch.equal(one_by_one[1], batched[1])
    if shift or flip:  # the augmentation did something: not the plain normalised images
        assert not torch.equal(
            batched[0],
            default_collate([ds.__class__(images, labels, 0.3, 0.2, size=size)[i] for i in order])[0],
        )


def test_the_dataloader_takes_the_batched_path():
    ds = TensorImageDataset(torch.rand(20, 1, 8, 8), torch.arange(20) % 10, 0.0, 1.0, shift=1)
    calls = []
    fetch = ds.__getitems__
    ds.__getitems__ = lambda idx: calls.append(list(idx)) or fetch(idx)
    batches = list(DataLoader(ds, batch_size=8, collate_fn=collate))
    assert calls == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    assert [b[0].shape for b in batches] == [(8, 1, 8, 8), (8, 1, 8, 8), (4, 1, 8, 8)]


@pytest.mark.parametrize("augment", [False, True])
def test_the_synthetic_set_is_made_once_and_gives_the_images_generated_on_access(augment, monkeypatch):
    made = SyntheticImages(40, 10, 8, seed=3, split=0, augment=augment)
    assert made.images is not None and made.images.shape == (40, 3, 8, 8)
    monkeypatch.setattr("ddpkit.data.tensor_sets.SYNTHETIC_MADE_ONCE_BYTES", 0)
    generated = SyntheticImages(40, 10, 8, seed=3, split=0, augment=augment)
    assert generated.images is None  # too large to keep: generated on each access
    order = [7, 0, 39, 7, 12]
    torch.manual_seed(1)
    a = collate(made.__getitems__(order))
    torch.manual_seed(1)
    b = collate(generated.__getitems__(order))
    torch.manual_seed(1)
    c = default_collate([made[i] for i in order])
    for x, y in ((a, b), (a, c)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_ddpkit_loaders_hand_over_whole_batches_of_their_own_sets():
    ds = SyntheticImages(10, 10, 8, seed=0, split=1)
    (x, y), (x2, y2) = eval_loader(ds, 6, rank=0, world_size=1)
    assert x.shape == (6, 3, 8, 8) and torch.equal(y, ds.labels[:6]) and torch.equal(x2, ds.images[6:])


def test_a_converted_loader_over_them_keeps_the_whole_batches():
    from ddpkit.data.loaders import convert_loader

    ds = SyntheticImages(12, 10, 8, seed=0, split=0)
    (x, y), *_ = convert_loader(DataLoader(ds, batch_size=4), rank=0, world_size=1)
    assert x.shape == (4, 3, 8, 8) and torch.equal(y, ds.labels[:4])


def test_a_plain_dataloader_over_ddpkit_sets_gets_samples_and_stacks_them():
    # a user's own torch DataLoader (the examples' scripts) over ddpkit's in-memory sets: default_collate works;
    # only ddpkit's loaders, whose collate takes them, get whole stacked batches from __getitems__
    for ds in (
        TensorImageDataset(torch.rand(10, 1, 8, 8), torch.arange(10) % 3, 0.5, 0.25),
        SyntheticImages(10, 3, 8, seed=0, split=0),
    ):
        x, y = next(iter(DataLoader(ds, batch_size=4)))
        assert x.shape[0] == 4 and y.shape == (4,)
