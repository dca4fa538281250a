"""The resumable training state (ddpkit.train.train_state): what a checkpoint carries and how a rerun continues."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import run_group
from ddpkit.data import DistributedLoader
from ddpkit.train.train_state import STATE_KEYS, TrainState

CPU = torch.device("cpu")


def _dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n) % 2)


def _state(rank: int = 0, world_size: int = 1, batch_size: int = 2) -> TrainState:
    loader = DistributedLoader(_dataset(), batch_size, seed=3, rank=rank, world_size=world_size)
    return TrainState(loader, seed=5, rank=rank, world_size=world_size, device=CPU)


def _train_on(state: TrainState, batches, rank: int, steps: int) -> None:
    for _ in range(steps):
        _, y = next(batches)
        logits = torch.nn.functional.one_hot(y, 2).float()  # every sample right
        state.sums.add(torch.tensor(float(rank + 1)), logits, y)
        state.step += 1


def _round_trip(rank: int, world_size: int) -> dict:
    state = _state(rank, world_size)
    state.begin_epoch(1)
    batches = iter(state.loader)
    _train_on(state, batches, rank, 3)
    saved = state.state_dict()
    means = state.epoch_means()
    after = torch.rand(3)  # what this rank's RNG gives next
    rest = [x.flatten().tolist() for x, _ in batches]  # the samples this rank still had to see
    batches.close()

    fresh = _state(rank, world_size)  # a new process: another loader, another RNG position
    torch.manual_seed(1234)
    fresh.load_state_dict(saved)
    fresh.begin_epoch(1)  # goes on where the checkpoint left the epoch
    return {
        "saved": {k: v for k, v in saved.items() if k != "rng"},
        "rng_ranks": len(saved["rng"]),
        "position": (fresh.epoch, fresh.step, fresh.consumed),
        "same_rng": torch.equal(torch.rand(3), after),
        "same_rest": [x.flatten().tolist() for x, _ in fresh.loader] == rest,
        "same_means": fresh.epoch_means() == means,
        "resumed_samples": fresh.resumed_samples,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_mid_epoch_state_round_trips_on_a_real_group(world_size):
    results = run_group(_round_trip, world_size)
    consumed = 3 * 2 * world_size  # 3 micro-batches of 2 samples on every rank
    for rank, r in enumerate(results):
        assert set(r["saved"]) | {"rng"} == set(STATE_KEYS)
        assert r["saved"]["consumed"] == consumed and r["saved"]["epoch"] == 0 and r["saved"]["step"] == 3
        # the partial sums are over all ranks: each rank's loss (rank + 1) x its 6 samples, all correct
        expected = [sum(6.0 * (q + 1) for q in range(world_size)), float(consumed), float(consumed)]
        assert r["saved"]["partial_sums"] == expected
        assert r["rng_ranks"] == world_size  # every rank's streams
        assert r["position"] == (0, 3, consumed)
        assert r["same_rng"] and r["same_rest"], rank
        assert r["same_means"]  # the resumed sums count the earlier part of the epoch exactly once
        assert r["resumed_samples"] == consumed


def test_an_epoch_counts_as_finished_only_when_its_pass_ended():
    state = _state()
    state.begin_epoch(1)
    with_stop = iter(state.loader)
    _train_on(state, with_stop, 0, 2)
    with_stop.close()  # stopped early (a signal, train.max_steps)
    assert state.consumed == 4 and not state.end_epoch(1) and state.epoch == 0
    assert "4 samples into epoch 1" in state.describe()
    for _ in state.loader:  # the rest of the epoch
        pass
    assert state.consumed == 0 and state.end_epoch(1) and state.epoch == 1
    assert state.describe() == "epoch 1, step 2"


def test_an_old_checkpoint_without_the_mid_epoch_entries_starts_the_next_epoch():
    state = _state()
    state.load_state_dict({"model": {}, "epoch": 2, "step": 40})
    assert (state.epoch, state.step, state.consumed, state.best_acc1) == (2, 40, 0, -1.0)
    state.begin_epoch(3)
    order = state.loader.sampler.global_order()  # epoch 3's order
    first, _ = next(iter(state.loader))
    assert first.flatten().tolist() == order[:2].float().tolist()


def test_a_checkpoint_of_another_world_size_keeps_the_position_not_the_streams():
    two_ranks = {
        "epoch": 0,
        "step": 3,
        "consumed": 12,
        "partial_sums": [6.0, 12.0, 12.0],
        "best_acc1": 0.5,
        "world_size": 2,
        "rng": [{"torch": torch.get_rng_state()}] * 2,  # never applied: two ranks' streams for one process
    }
    state = _state()
    torch.manual_seed(9)
    expected = torch.rand(2)
    torch.manual_seed(9)
    state.load_state_dict(two_ranks)
    assert torch.equal(torch.rand(2), expected)
    state.begin_epoch(1)
    order = state.loader.sampler.global_order()
    first, _ = next(iter(state.loader))
    assert first.flatten().tolist() == order[12:14].float().tolist()
    assert state.epoch_means() == (0.5, 1.0, 12)
