"""What prepare() does with a DataLoader, decided without a silent guess.

A loader's role is the user's (`prepare(..., roles=["train", "eval"])`) or guessed from `shuffle=`: shuffled ->
training (padded, shuffled, even shards), unshuffled -> evaluation (every sample once, shards that may differ by
one sample). A guess is checked when the loader starts a pass: a guessed evaluation loader iterated while the
model trains (its uneven shards would put DDP's all-reduces out of step), or a guessed training loader iterated
while the model evaluates (its padding counts samples twice), raises before the first batch, saying how to state
the role. A guessed training loader iterated under torch.no_grad() evaluates, whatever the model's mode (a test
loop that forgot model.eval()): that pass yields every sample once over the ranks, unpadded. An explicit
evaluation loader iterated by a training model is refused too. One process has no uneven or padded shard, so
nothing is checked there.

Also: a loader prepare() already made is returned as it is (prepare twice is harmless), and a loader that
already has a DistributedSampler for this world is accepted as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddpkit.data.loaders import DistributedLoader, convert_loader
from ddpkit.data.sampler import ExactEvalSampler, GlobalOrderSampler
from ddpkit.distributed.collectives import all_gather_object, get_world_size
from ddpkit.errors import UserError
from ddpkit.parallel.strategy import unwrap_module

ROLES = ("train", "eval")
_HINT = "say so: roles=['train', 'eval']"


class _LastModel:
    """The model prepare() returned last (what a loader prepared without one is checked against)."""

    ref: Callable[[], Any] = staticmethod(lambda: None)


def remember_model(model: Any) -> None:
    _LastModel.ref = weakref.ref(model)


def roles_for(objects: Sequence[Any], roles: Sequence[str] | None) -> list[str | None]:
    """One role (or None: guess) per DataLoader among `objects`, in order; UserError for a bad `roles`."""
    loaders = [o for o in objects if isinstance(o, DataLoader | DistributedLoader)]
    if roles is None:
        return [None] * len(loaders)
    if isinstance(roles, str) or len(roles) != len(loaders) or any(r not in ROLES for r in roles):
        raise UserError(
            f"ddpkit.prepare: roles={roles!r} must name 'train' or 'eval' for each of the {len(loaders)} loader(s)",
            "e.g. roles=['train', 'eval'] for prepare(model, optimizer, train, val)",
        )
    return list(roles)


def _check(
    loader_role: str, explicit: bool, world_size: int, model_ref: Callable[[], Any]
) -> Callable[[], None]:
    def check() -> bool | None:
        model = model_ref()
        model = _LastModel.ref() if model is None else model
        if model is None or world_size == 1:  # one process: no shard is uneven or padded
            return None
        training = bool(unwrap_module(model).training)  # `unwrap(model).eval()` counts as model.eval()
        if loader_role == "eval" and training:
            how = "guessed from shuffle=False" if not explicit else "roles= says so"
            raise UserError(
                f"ddpkit.prepare: a loader prepared for evaluation ({how}) is run in train mode",
                f"if it trains, {_HINT} (or shuffle=True); if it evaluates, call model.eval()",
            )
        if loader_role == "train" and not explicit and not torch.is_grad_enabled():
            return (
                True  # under torch.no_grad() a pass evaluates, whatever the model's mode: every sample once
            )
        if loader_role == "train" and not training and not explicit:
            raise UserError(
                "ddpkit.prepare: a loader guessed to be for training is run in eval mode",
                f"if it evaluates, {_HINT} (or shuffle=False); if it trains, call model.train()",
            )
        return None

    return check


def _already_sharded(loader: Any, world_size: int, rank: int) -> bool:
    """Made by prepare() or ddpkit's loaders already, or given a DistributedSampler for this world by the user."""
    if isinstance(loader, DistributedLoader):
        return True
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ExactEvalSampler | GlobalOrderSampler):
        return True
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != world_size or sampler.rank != rank:
            raise UserError(
                f"ddpkit.prepare: the loader's DistributedSampler is for rank {sampler.rank} of "
                f"{sampler.num_replicas}, this process is rank {rank} of {world_size}",
                "make it after ddpkit.init_distributed()",
            )
        return True
    return False


def prepare_loader(
    loader: Any,
    role: str | None,
    *,
    seed: int,
    rank: int,
    world_size: int,
    model: Any = None,
    split: bool = False,
) -> Any:
    """The loader for this process, with its role checked at every pass (see the module's docstring); `split`:
    convert_loader's."""
    if _already_sharded(loader, world_size, rank):
        return loader
    made = convert_loader(
        loader, seed=seed, rank=rank, world_size=world_size, role=role, plain_rng=world_size == 1, split=split
    )
    made_role = "train" if isinstance(made, DistributedLoader) else "eval"
    model_ref = weakref.ref(model) if model is not None else (lambda: None)
    sampler = made.sampler
    sampler.on_iter = _check(made_role, role is not None, world_size, model_ref)
    return agreed(made)


def agreed(loader: Any) -> Any:
    """`loader`, whose ranks check at each pass that they drew one order where each draws it as one process does
    (from its generator= or torch's stream: one data-parallel replica, or split_batches): ranks seeded apart
    would read other samples than one another, silently."""
    sampler = getattr(loader, "sampler", None)
    if getattr(sampler, "draw_seed", False) and get_world_size() > 1:
        sampler.agree = _same_order
    return loader


def _same_order(mark: int) -> None:
    if len(set(all_gather_object(mark))) > 1:
        raise UserError(
            "ddpkit.prepare: the ranks drew different orders for a training loader",
            "seed it alike on every rank before the pass: torch.manual_seed(S) or DataLoader(generator=...)",
        )
