"""TensorImageDataset's batched fetch (__getitems__, which DataLoader calls with a whole batch of indices) gives
the images its per-sample path gives, from the same random stream. Budget: 2 s (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from ddpkit.data.tensor_sets import TensorImageDataset


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
    batched = default_collate(ds.__getitems__(order))
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
    batches = list(DataLoader(ds, batch_size=8))
    assert calls == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    assert [b[0].shape for b in batches] == [(8, 1, 8, 8), (8, 1, 8, 8), (4, 1, 8, 8)]
