"""Parallel strategies (ddpkit.parallel.strategy) on real gloo groups: wrapping, gradient sync, full state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import dist_context, plain, run_group
from ddpkit.distributed.collectives import broadcast_object
from ddpkit.errors import UserError
from ddpkit.parallel.plan import build_strategy, resolve_strategy
from ddpkit.parallel.strategy import Strategy


def test_auto_is_ddp_with_several_processes_and_single_with_one():
    assert resolve_strategy("auto", 1) == "single" and resolve_strategy("auto", 4) == "ddp"
    for name in ("single", "dp"):
        with pytest.raises(UserError, match=f"dist.strategy={name} runs one process but 2 were started"):
            resolve_strategy(name, 2)


def test_the_layout_plan_asks_the_entries_facts_not_their_names():
    """A strategy of your own that replicates like ddp runs around pipeline stages, one that shards in groups
    like hsdp gets its sharding group, and auto's picks are facts of the entries."""
    from ddpkit.config import load_config
    from ddpkit.parallel import strategy as registry
    from ddpkit.parallel.mesh import layout_of
    from ddpkit.parallel.plan import check_config, pipeline_strategy
    from ddpkit.parallel.strategies.ddp import DDPStrategy
    from ddpkit.parallel.strategies.hsdp import HSDPStrategy

    assert [registry.picked(s) for s in ("one", "several", "tp", "offload")] == [
        "single",
        "ddp",
        "zero2",
        "fsdp",
    ]
    mine = [
        registry.StrategyEntry("myddp", DDPStrategy, "ddp again", replicates=True, with_pp=True),
        registry.StrategyEntry("myhsdp", HSDPStrategy, "hsdp again", over_dtensors=True, hybrid=True),
    ]
    try:
        for entry in mine:
            registry.register_strategy(entry)
        assert pipeline_strategy("myddp", layout_of(4, 1, 2)) == "myddp"
        with pytest.raises(UserError, match="dist.strategy=myddp cannot run over tensor-parallel"):
            pipeline_strategy("myddp", layout_of(8, 2, 2))
        cfg = load_config(None, ["dist.strategy=myhsdp"])
        assert check_config(cfg, 8, per_node=4).dp_shard == 4
        with pytest.raises(UserError, match="cannot run over the data-parallel ranks of a pipeline"):
            pipeline_strategy("myhsdp", layout_of(4, 1, 2))  # it does not say with_pp
    finally:
        for entry in mine:
            registry._REGISTRY.unregister(entry.name)


def test_a_single_process_without_a_group_gets_the_plain_module():
    strategy = build_strategy("ddp", dist_context(0, 1))
    assert type(strategy) is Strategy
    model = nn.Linear(2, 2)
    assert strategy.wrap(model) is model and strategy.unwrap(model) is model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _grads(module: nn.Module) -> list[float]:
    return [float(p.grad.sum()) for p in module.parameters()]


def _ddp_sync(rank: int, world_size: int) -> dict:
    strategy = build_strategy("ddp", dist_context(rank, world_size))
    wrapped = strategy.wrap(_model())
    x = torch.full((3, 4), float(rank + 1))  # different data on every rank
    with strategy.sync_context(wrapped, sync=False):
        wrapped(x).sum().backward()
    local = _grads(wrapped)  # no_sync: this rank's own gradient
    with strategy.sync_context(wrapped, sync=True):
        wrapped(x).sum().backward()  # accumulates, then all-reduces the sum of both micro-batches
    return {"local": local, "synced": _grads(wrapped), "keys": list(strategy.model_state(wrapped))}


@pytest.mark.slow
def test_ddp_syncs_gradients_only_on_the_last_micro_batch():
    rank0, rank1 = run_group(_ddp_sync, 2)
    assert rank0["local"] != rank1["local"]  # not averaged yet
    assert rank0["synced"] == pytest.approx(rank1["synced"])  # averaged over the ranks
    expected = [
        (a + b) for a, b in zip(rank0["local"], rank1["local"], strict=True)
    ]  # 2 micro-batches x mean
    assert rank0["synced"] == pytest.approx(expected, rel=1e-5)
    assert rank0["keys"] == list(_model().state_dict())  # the user's module: no `module.` prefix


def _full_state(rank: int, world_size: int, name: str) -> dict:
    strategy = build_strategy(name, dist_context(rank, world_size))
    model = _model()
    wrapped = strategy.wrap(model)
    optimizer = strategy.build_optimizer(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    )
    wrapped(torch.full((3, 4), float(rank + 1))).sum().backward()
    optimizer.step()
    model_sd = strategy.model_state(wrapped)
    optim_sd = strategy.optimizer_state(wrapped, optimizer)  # collective: every rank calls it
    # a fresh model and optimizer take the full state back
    fresh = _model()
    fresh_wrapped = strategy.wrap(fresh)
    fresh_optimizer = strategy.build_optimizer(
        fresh, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    )
    saved = plain(model_sd)  # before loading: fsdp's loader turns the dict it is given into shards
    model_sd0, optim_sd0 = broadcast_object([model_sd, optim_sd])  # rank 0's, as its checkpoint file would be
    strategy.load(fresh_wrapped, fresh_optimizer, model_sd0, optim_sd0)
    return {
        "model": saved,
        "reloaded": plain(strategy.model_state(fresh_wrapped)),
        "has_optimizer_state": optim_sd is not None,
        "momentum_keys": len(optim_sd["state"]) if optim_sd is not None else 0,
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero1", "fsdp"])
def test_full_model_and_optimizer_state_on_rank_0_and_back(name):
    rank0, rank1 = run_group(_full_state, 2, name)
    assert list(rank0["model"]) == list(_model().state_dict())  # full, plain keys, under every strategy
    for key, value in rank0["model"].items():
        assert value.shape == tuple(_model().state_dict()[key].shape)
        assert (rank0["reloaded"][key] == value).all(), key
    assert rank0["has_optimizer_state"] and rank0["momentum_keys"] == 4  # every parameter's momentum
    gathered_on_rank_0_only = name in ("zero1", "fsdp")
    assert rank1["has_optimizer_state"] is not gathered_on_rank_0_only


def _conv() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def _channels_last_step(rank: int, world_size: int, name: str) -> dict:
    strategy = build_strategy(name, dist_context(rank, world_size))
    model = _conv().to(memory_format=torch.channels_last)  # what model.channels_last=true does
    wrapped = strategy.wrap(model)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank)).contiguous(
        memory_format=torch.channels_last
    )
    wrapped(x).sum().backward()
    return {"state": plain(strategy.model_state(wrapped))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero2"])
def test_sharding_strategies_take_a_channels_last_model(name):
    """FSDP2 refuses parameters that are not contiguous: the strategy gives it the standard layout."""
    rank0, _ = run_group(_channels_last_step, 2, name)
    assert {k: v.shape for k, v in rank0["state"].items()} == {
        k: v.shape for k, v in _conv().state_dict().items()
    }
    for key, value in _conv().state_dict().items():  # no step taken: the values as they were
        assert torch.equal(torch.from_numpy(rank0["state"][key]), value), key
