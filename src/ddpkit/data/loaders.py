"""Loaders: the training loader over a GlobalOrderSampler, the exact evaluation loader, and the conversion of a
user's own DataLoader into one of them (what `ddpkit.prepare` does with loaders)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from ddpkit.data.checked import collate_for
from ddpkit.data.sampler import ExactEvalSampler, GlobalOrderSampler
from ddpkit.distributed.collectives import derive_seed, get_rank, get_world_size
from ddpkit.errors import UserError

if TYPE_CHECKING:
    from ddpkit.config import Config

# DataLoader arguments a converted loader keeps (everything but how the indices are chosen).
KEPT_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class _SeedWorker:
    """worker_init_fn: seed python `random` and numpy from the worker's torch seed, then the user's own fn."""

    def __init__(self, user_fn: Callable[[int], Any] | None = None):
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        s = torch.initial_seed() % 2**32
        random.seed(s)
        np.random.seed(s)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _loader_kwargs(kwargs: dict[str, Any], dataset: Dataset) -> dict[str, Any]:
    """DataLoader keyword arguments, with pin_memory only where a GPU can use it and worker-only ones dropped;
    with no collate_fn of the caller's own (none, or torch's default), the data set's `ddpkit_collate` when it
    has one (ddpkit's in-memory sets hand over whole batches, stacked already)."""
    out = dict(kwargs)
    if out.get("collate_fn") in (None, default_collate) and hasattr(dataset, "ddpkit_collate"):
        out["collate_fn"] = dataset.ddpkit_collate
        dataset.batched = True  # its __getitems__ may hand over stacked batches: this collate passes them on
    workers = int(out.get("num_workers") or 0)
    if out.get("pin_memory") and not torch.cuda.is_available():
        out["pin_memory"] = False  # pinning without a GPU only costs memory (and warns)
        out.pop("pin_memory_device", None)
    if not workers:
        for key in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout"):
            out.pop(key, None)
    out["worker_init_fn"] = _SeedWorker(out.get("worker_init_fn")) if workers else out.get("worker_init_fn")
    return out


class DistributedLoader:
    """A DataLoader over a GlobalOrderSampler: set_epoch is automatic, worker seeds differ per (seed, rank,
    epoch), and its position (epoch, samples consumed) can be saved and restored.

    `set_epoch(e)` on the loader or on `loader.sampler` chooses the next pass's epoch, as with
    DistributedSampler; without it, every pass (even one broken early) moves on to the next epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        grad_accum_steps: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        plain_rng: bool = False,
        **loader_kwargs: Any,
    ):
        if isinstance(dataset, IterableDataset):
            raise UserError(
                "a distributed loader needs a map-style data set (__len__, __getitem__), not an IterableDataset",
                "shard an IterableDataset yourself with ddpkit.get_rank() / ddpkit.get_world_size()",
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = get_rank() if rank is None else int(rank)
        self.world_size = get_world_size() if world_size is None else int(world_size)
        self.sampler = GlobalOrderSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            self.rank,
            self.world_size,
            seed,
            shuffle=shuffle,
            grad_accum_steps=grad_accum_steps,
            drop_last=drop_last,
        )
        # plain_rng: draw from torch's global RNG as a plain DataLoader does (its worker seed, the shuffle
        # seed) instead of generators of its own: prepare() in one process, where the script must stay the same
        # random stream as before it was ported.
        self.sampler.draw_seed = plain_rng
        if (
            plain_rng
        ):  # the order comes from the DataLoader's generator= as RandomSampler takes it, if it has one
            self.sampler.generator = loader_kwargs.get("generator")
        self._user_generator = plain_rng or loader_kwargs.get("generator") is not None
        self._pass_rng: torch.Tensor | None = None  # the user's generator's state when this pass began
        kwargs = _loader_kwargs(loader_kwargs, dataset)
        if not plain_rng:
            kwargs.setdefault("generator", self._generator(0))
        self.loader = DataLoader(
            dataset, batch_size=self.batch_size, sampler=self.sampler, drop_last=False, **kwargs
        )
        self.num_workers = self.loader.num_workers
        # move(batches) -> the batches on the device (data.prefetch.DeviceBatches: on CUDA one batch ahead); a
        # batch counts as consumed when it is handed over, not when it was drawn ahead
        self.move: Callable[[Any], Iterator[Any]] | None = None
        self._running: tuple[int, int] | None = None  # (epoch, start) of the pass in progress
        self._done = 0  # micro-batches the pass in progress (or the last one) has yielded
        self._stopped: tuple[int, int, int] | None = (
            None  # (epoch, consumed, explicit) of a pass broken early
        )

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, self.rank, epoch))

    @property
    def epoch(self) -> int:
        """The epoch of the next pass."""
        return self.sampler.epoch

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per rank in a whole epoch."""
        return self.sampler.micro_batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order for the next pass (from its beginning)."""
        self.sampler.set_epoch(epoch)

    def set_start(self, consumed: int) -> None:
        """Skip the first `consumed` samples of the next pass's global order (mid-epoch resume)."""
        self.sampler.set_start(consumed)
        self._stopped = None

    def __len__(self) -> int:
        return self.sampler.num_micro_batches(self.sampler.start)

    def _consumed(self, start: int) -> int:
        return min(start + self._done * self.sampler.global_batch, self.sampler._length())

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "consumed"}: where the next sample comes from (mid-pass: the current position; after a
        pass broken early: where it stopped)."""
        drawn = {"drawn": self.sampler.drawn} if self.sampler.draw_seed else {}
        g = self.sampler.generator if self.sampler.draw_seed else None
        if g is not None:  # restored, the pass in progress draws its seeds and order again
            drawn["generator"] = self._pass_rng if self._running is not None else g.get_state()
        if self._running is not None:
            epoch, start = self._running
            return {"epoch": epoch, "consumed": self._consumed(start), **drawn}
        if self._stopped is not None and self._stopped[2] == self.sampler.explicit:  # nobody chose since
            return {"epoch": self._stopped[0], "consumed": self._stopped[1], **drawn}
        return {"epoch": self.sampler.epoch, "consumed": self.sampler.start, **drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a state_dict(): the next pass is that epoch, from that sample."""
        self.set_epoch(int(state["epoch"]))
        self.set_start(int(state.get("consumed", 0)))
        if state.get("drawn") is not None:
            self.sampler.drawn = int(state["drawn"])
        if state.get("generator") is not None and self.sampler.generator is not None:
            self.sampler.generator.set_state(state["generator"])

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        epoch, explicit, start = s.epoch, s.explicit, s.start
        if not self._user_generator:
            # Worker seeds are drawn from this generator when workers start (persistent workers: once).
            self.loader.generator = self._generator(epoch)
        self._running, self._done, self._stopped = (epoch, start), 0, None
        if self.sampler.draw_seed and self.sampler.generator is not None:
            self._pass_rng = self.sampler.generator.get_state()
        total = len(self)
        batches = self.loader if self.move is None else self.move(self.loader)
        try:
            for batch in batches:
                self._done += 1
                yield batch
        finally:
            if self.move is not None:
                batches.close()  # type: ignore[union-attr]
            self._running = None
            if s.explicit == explicit:  # nobody chose the next epoch during the pass: move on
                if self._done < total:
                    self._stopped = (epoch, self._consumed(start), explicit)
                s.epoch = epoch + 1
            if s.start_epoch == epoch:  # this pass used the resume position: it is spent
                s.start = 0


def distributed_loader(dataset: Dataset, batch_size: int, **kwargs: Any) -> DistributedLoader:
    """A training loader: this rank's share of the global order, batch_size per process, set_epoch automatic.

    Takes DistributedLoader's keywords (shuffle, seed, drop_last, grad_accum_steps, rank, world_size) and every
    DataLoader one (num_workers, collate_fn, pin_memory, ...); workers persist between epochs unless told not to.
    """
    if kwargs.get("num_workers"):
        kwargs.setdefault("persistent_workers", True)
    return DistributedLoader(dataset, batch_size, **kwargs)


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    plain_rng: bool = False,
    **loader_kwargs: Any,
) -> DataLoader:
    """An evaluation loader: every sample exactly once over all ranks (no padding, no duplicates).

    The shards are contiguous and in rank order, so `ddpkit.gather` of per-sample results is in data set order.
    """
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    sampler = ExactEvalSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
    # Its own generator: a DataLoader without one draws a seed from the global RNG at every pass, so an
    # evaluation would shift the training random stream (a run evaluated at a stop would resume differently).
    # (plain_rng: as DistributedLoader's.)
    if loader_kwargs.get("generator") is None and not plain_rng:
        loader_kwargs["generator"] = torch.Generator().manual_seed(0)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=False,
        **_loader_kwargs(loader_kwargs, dataset),
    )


def _kept(loader: DataLoader) -> dict[str, Any]:
    out = {}
    for name in KEPT_ARGS:
        if hasattr(loader, name):
            out[name] = getattr(loader, name)
    if out.get("num_workers", 0) == 0:
        out.pop("prefetch_factor", None)
    return out


def _check_shardable(loader: DataLoader) -> None:
    """A UserError saying what to do instead when ddpkit cannot shard this loader for the user."""
    if isinstance(loader.dataset, IterableDataset):
        raise UserError(
            "ddpkit.prepare cannot shard a DataLoader over an IterableDataset",
            "shard it inside the data set with ddpkit.get_rank() / ddpkit.get_world_size(), and leave it out of prepare()",
        )
    sampler = loader.sampler
    if loader.batch_size is None or type(loader.batch_sampler).__name__ != "BatchSampler":
        raise UserError(
            "ddpkit.prepare cannot shard a DataLoader built with a batch_sampler of its own",
            "give it batch_size= and shuffle= instead, or shard the batches yourself with ddpkit.get_rank()",
        )
    if type(sampler) not in (RandomSampler, SequentialSampler):
        raise UserError(
            f"ddpkit.prepare cannot shard a DataLoader with a {type(sampler).__name__}",
            "use shuffle=True or shuffle=False (ddpkit shards them), or build the loader with ddpkit.distributed_loader",
        )
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None):
        raise UserError(
            "ddpkit.prepare cannot shard a RandomSampler with replacement or num_samples",
            "use shuffle=True without them, or shard the loader yourself",
        )


def convert_loader(
    loader: DataLoader,
    *,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    role: str | None = None,
    plain_rng: bool = False,
    split: bool = False,
):
    """A user's DataLoader re-made as a distributed one that keeps all its other arguments.

    shuffle=True (a RandomSampler) -> a DistributedLoader (training: the global order, set_epoch automatic);
    shuffle=False (a SequentialSampler) -> an exact evaluation loader (every sample once over all ranks), or,
    with drop_last=True, an unshuffled DistributedLoader. `role` ("train"/"eval") overrides that guess;
    `plain_rng`: as DistributedLoader's. `split` (a training loader): its batch_size is the global batch, each of
    the world_size ranks reading batch_size / world_size of every batch in the one-process order (plain_rng), so
    the ranks together read the batches the DataLoader itself gives. Any other sampler, a batch_sampler of the
    user's own or an IterableDataset cannot be sharded for them: a UserError says what to do instead.
    """
    if isinstance(loader, DistributedLoader):
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(f"expected a torch DataLoader, got {type(loader).__name__}")
    _check_shardable(loader)
    sampler = loader.sampler
    kwargs = _kept(loader)
    shuffle = isinstance(sampler, RandomSampler)
    if role is None:
        role = "train" if shuffle or loader.drop_last else "eval"
    if role == "train":
        world = get_world_size() if world_size is None else world_size
        batch = loader.batch_size
        if split and world > 1:
            if batch % world:
                raise UserError(
                    f"ddpkit.prepare(split_batches=True) cuts each batch of {batch} samples over {world} data-parallel "
                    "ranks, unevenly",
                    f"use a batch_size {world} divides, or drop split_batches",
                )
            batch, plain_rng = batch // world, True
        return DistributedLoader(
            loader.dataset,
            batch,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            rank=rank,
            world_size=world_size,
            plain_rng=plain_rng,
            **kwargs,
        )
    return eval_loader(
        loader.dataset, loader.batch_size, rank=rank, world_size=world_size, plain_rng=plain_rng, **kwargs
    )


def build_loaders(
    cfg: Config, rank: int, world_size: int, train_ds: Dataset, val_ds: Dataset
) -> tuple[DistributedLoader, DataLoader]:
    """The trainer's (train, val) loaders from cfg.train, cfg.eval, cfg.data and cfg.seed."""
    workers = cfg.data.num_workers
    common = {"num_workers": workers, "pin_memory": cfg.data.pin_memory, "persistent_workers": workers > 0}
    train = DistributedLoader(
        train_ds,
        cfg.train.batch_size,
        shuffle=True,
        seed=cfg.seed,
        grad_accum_steps=cfg.train.grad_accum_steps,
        rank=rank,
        world_size=world_size,
        collate_fn=collate_for(train_ds, training=True),
        **common,
    )
    val = eval_loader(
        val_ds,
        cfg.eval.batch_size or cfg.train.batch_size,
        rank=rank,
        world_size=world_size,
        collate_fn=collate_for(val_ds, training=False),
        **common,
    )
    return train, val
