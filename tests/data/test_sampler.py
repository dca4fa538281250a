"""The global-order training sampler (the same global order on any world size, equal steps on every rank, resuming
on another world size) and the exact evaluation sampler (every index once). Budget: 2 s (no processes)."""

from __future__ import annotations

import pytest

from ddpkit.data import (
    ExactEvalSampler,
    GlobalOrderSampler,
)
from ddpkit.errors import UserError

# ---------------------------------------------------------------- GlobalOrderSampler


def _ranks(n, batch, world, seed=0, epoch=0, accum=1, start=0, shuffle=True):
    out = []
    for r in range(world):
        s = GlobalOrderSampler(n, batch, r, world, seed, shuffle=shuffle, grad_accum_steps=accum)
        s.set_epoch(epoch)
        s.set_start(start)
        idx = list(s)
        assert len(idx) == len(s)
        out.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return out


def _global_steps(per_rank):
    """Per global micro-step, the samples all ranks train on together (sorted: DDP averages over the union)."""
    return [sorted(sum((per_rank[r][i] for r in range(len(per_rank))), [])) for i in range(len(per_rank[0]))]


def test_same_global_order_on_any_world_size():
    one = _global_steps(_ranks(200, 16, 1))
    assert _global_steps(_ranks(200, 8, 2)) == one
    assert _global_steps(_ranks(200, 4, 4)) == one
    # 2 processes x B/2 with 2 accumulation micro-steps cover the 1-process optimizer step
    accum = _global_steps(_ranks(200, 4, 2, accum=2))
    assert [sorted(accum[i] + accum[i + 1]) for i in range(0, len(accum), 2)] == one
    s = GlobalOrderSampler(200, 16, 0, 1, 0)
    order = s.global_order().tolist()
    assert one == [sorted(order[i : i + 16]) for i in range(0, len(one) * 16, 16)]
    assert _ranks(40, 4, 2, shuffle=False)[1][0] == [1, 3, 5, 7]  # DistributedSampler's interleaving


def test_equal_steps_on_every_rank_and_accum_rounding():
    per_rank = _ranks(1001, 10, 3)
    assert [len(p) for p in per_rank] == [33, 33, 33]  # 1001 // 30 global micro-batches, 11 samples dropped
    seen = sum(_global_steps(per_rank), [])
    assert len(seen) == len(set(seen)) == 990
    per_rank = _ranks(1001, 10, 3, accum=4)
    assert [len(p) for p in per_rank] == [32, 32, 32]  # rounded down to a multiple of grad_accum_steps
    assert GlobalOrderSampler(1001, 10, 0, 3, 0, grad_accum_steps=4).micro_batches_per_epoch == 32


def test_epochs_differ_and_repeat():
    e0, e1 = _ranks(100, 10, 1, epoch=0), _ranks(100, 10, 1, epoch=1)
    assert e0 != e1 and sorted(sum(e0[0], [])) == sorted(sum(e1[0], [])) == list(range(100))
    assert _ranks(100, 10, 1, epoch=1, seed=3) == _ranks(100, 10, 1, epoch=1, seed=3)
    assert _ranks(100, 10, 1, seed=3) != _ranks(100, 10, 1, seed=4)


def test_set_start_resumes_on_other_world_sizes():
    n, epoch = 1000, 2
    full = GlobalOrderSampler(n, 8, 0, 1, 5)
    full.set_epoch(epoch)
    order = full.global_order().tolist()
    k = 7  # micro-batches done at world size 2, batch 8 -> consumed 7 * 16 samples
    before = sum(_global_steps(_ranks(n, 8, 2, seed=5, epoch=epoch))[:k], [])
    consumed = k * 16
    assert sorted(before) == sorted(order[:consumed])
    for world, batch in ((1, 16), (4, 4), (3, 8)):
        after = sum(_global_steps(_ranks(n, batch, world, seed=5, epoch=epoch, start=consumed)), [])
        assert sorted(after) == sorted(
            order[consumed : consumed + len(after)]
        )  # the same remaining global order
        assert not set(after) & set(before)  # nothing seen twice
        assert len(after) == (n - consumed) // (batch * world) * batch * world
    s = GlobalOrderSampler(n, 8, 0, 2, 5)
    s.set_start(consumed)
    assert len(s) == (n - consumed) // 16 * 8
    s.set_epoch(3)  # a new epoch starts from its beginning
    assert len(s) == s.micro_batches_per_epoch * 8
    with pytest.raises(UserError):
        s.set_start(n + 1)


def test_too_small_dataset_is_a_user_error():
    with pytest.raises(UserError, match=r"10 samples.*train\.batch_size 32 x world size 2 = 64"):
        GlobalOrderSampler(10, 32, 0, 2, 0)
    with pytest.raises(UserError, match=r"grad_accum_steps"):
        GlobalOrderSampler(100, 16, 0, 2, 0, grad_accum_steps=4)
    GlobalOrderSampler(64, 32, 1, 2, 0)  # exactly one step is fine


# ---------------------------------------------------------------- ExactEvalSampler and eval_loader


@pytest.mark.parametrize("n", [359, 7, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_eval_every_index_once(n, world):
    shards = [list(ExactEvalSampler(n, r, world)) for r in range(world)]
    assert sum(shards, []) == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == [
        len(ExactEvalSampler(n, r, world)) for r in range(world)
    ]
