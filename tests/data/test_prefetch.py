"""Micro-batches moved to the device ahead of their step (data.prefetch): the same batches in the same order, and a
batch drawn ahead is not counted as consumed, so a checkpoint's position is exact. On a CPU the side stream is
none; `ahead=True` takes the one-batch-ahead path CUDA takes. Budget: 1 s (no processes)."""

from __future__ import annotations

import torch

from ddpkit.data.loaders import DistributedLoader
from ddpkit.data.prefetch import DeviceBatches
from ddpkit.data.tensor_sets import TensorImageDataset

CPU = torch.device("cpu")


def dataset() -> TensorImageDataset:
    return TensorImageDataset(torch.rand(40, 1, 4, 4), torch.arange(40) % 10, 0.0, 1.0)


def test_device_batches_are_the_batches_moved_in_order_with_or_without_ahead():
    batches = [(torch.rand(2, 3, 4, 4), torch.tensor([i, i])) for i in range(3)]
    assert DeviceBatches(CPU).ahead is False  # without CUDA: moved as they come
    for ahead in (False, True):
        moved = list(DeviceBatches(CPU, channels_last=True, ahead=ahead)(batches))
        assert [y.tolist() for _, y in moved] == [[0, 0], [1, 1], [2, 2]]
        assert all(torch.equal(x, b[0]) for (x, _), b in zip(moved, batches, strict=True))
        assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in moved)
    assert list(DeviceBatches(CPU, ahead=True)([])) == []


def test_a_batch_drawn_ahead_is_not_consumed_and_a_resume_continues_from_the_handed_over_one():
    plain = DistributedLoader(dataset(), 4, seed=1, rank=0, world_size=1)
    reference = [y.tolist() for _, y in plain]
    ahead = DistributedLoader(dataset(), 4, seed=1, rank=0, world_size=1)
    ahead.move = DeviceBatches(CPU, ahead=True)
    drawn = []
    fetch = ahead.dataset.__getitems__
    ahead.dataset.__getitems__ = lambda idx: drawn.append(idx) or fetch(idx)
    it = iter(ahead)
    first = [next(it)[1].tolist() for _ in range(3)]
    assert first == reference[:3] and len(drawn) == 4  # the fourth is in flight
    state = ahead.state_dict()
    assert state == {"epoch": 0, "consumed": 12}  # three handed over, not four
    it.close()
    again = DistributedLoader(dataset(), 4, seed=1, rank=0, world_size=1)
    again.move = DeviceBatches(CPU, ahead=True)
    again.load_state_dict(state)
    assert [y.tolist() for _, y in again] == reference[3:]
