"""Samplers: a rank's share of one global training order, and exact (duplicate-free) evaluation shards.

Training order: the order torch's `DistributedSampler(shuffle=True, seed=seed)` gives — a permutation of the
whole data set seeded with `seed + epoch`, rank r taking every world_size-th sample from position r — so a
script ported from the tutorials' DistributedSampler sees the very same batches. One global micro-batch is
`batch_size x world_size` consecutive positions of that order, whatever the world size: 1 process with batch
2B sees at every step the samples 2 processes with batch B see, and a run can stop mid-epoch and resume on
another world size without seeing a sample twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from ddpkit.errors import UserError


class GlobalOrderSampler(Sampler[int]):
    """This rank's share of the epoch's global order; every rank runs the same number of micro-batches.

    drop_last=True: the incomplete last global micro-batch is dropped (and the micro-batches are cut to a
    multiple of grad_accum_steps, so every optimizer step is whole). drop_last=False: as DistributedSampler,
    the order is padded with its own first samples to a multiple of world_size and the last micro-batch is
    smaller.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        grad_accum_steps: int = 1,
        drop_last: bool = True,
    ):
        if batch_size < 1 or world_size < 1 or grad_accum_steps < 1:
            raise ValueError("batch_size, world_size and grad_accum_steps must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.grad_accum_steps = int(grad_accum_steps)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.start = 0  # positions of the epoch's global order already consumed (mid-epoch resume)
        self.start_epoch = 0  # the epoch `start` belongs to
        self.explicit = 0  # how often set_epoch was called: a loader auto-advances only when nobody did
        # draw_seed: each pass's shuffle seed is drawn from torch's global RNG as RandomSampler draws it (one
        # process under prepare(): the same random stream as the user's own DataLoader); `drawn`: this pass's.
        self.draw_seed = False
        self.drawn: int | None = None
        # with draw_seed: the user's DataLoader's generator=, drawn from as RandomSampler draws (the order is
        # randperm from it, and a second randperm once the pass is used up); its permutation for the pass
        self.generator: torch.Generator | None = None
        self.perm: torch.Tensor | None = None
        # agree(fingerprint of this pass's order): the ranks' check that they drew one order (prepare())
        self.agree: Callable[[int], None] | None = None
        # a check before each pass (prepare()'s roles); True: this pass evaluates, every sample once
        self.on_iter: Callable[[], bool | None] | None = None
        need = self.global_batch * self.grad_accum_steps if self.drop_last else self.world_size
        if self.dataset_len < need:
            accum = f" x {self.grad_accum_steps} accumulated" if self.grad_accum_steps > 1 else ""
            raise UserError(
                f"the training set has {self.dataset_len} samples, fewer than a step "
                f"(train.batch_size {self.batch_size} x world size {self.world_size}{accum} = {need})",
                "lower train.batch_size, grad_accum_steps or the processes",
            )

    @property
    def global_batch(self) -> int:
        """Samples per global micro-batch: batch_size x world_size."""
        return self.batch_size * self.world_size

    def _length(self) -> int:
        """Positions of the (padded) global order an epoch uses."""
        if self.drop_last:
            return self.dataset_len
        return math.ceil(self.dataset_len / self.world_size) * self.world_size

    def num_micro_batches(self, consumed: int = 0) -> int:
        """Micro-batches every rank runs over the epoch's order after skipping `consumed` positions."""
        rest = max(0, self._length() - consumed)
        if not self.drop_last:
            return math.ceil(rest // self.world_size / self.batch_size)
        n = rest // self.global_batch
        return n - n % self.grad_accum_steps

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per rank in a whole epoch."""
        return self.num_micro_batches(0)

    @property
    def optimizer_steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch (micro-batches / grad_accum_steps, rounded up)."""
        return math.ceil(self.micro_batches_per_epoch / self.grad_accum_steps)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order for the next pass (DistributedSampler's method), from its beginning — or,
        right after a mid-epoch resume of that same epoch (set_start), from where the resume points."""
        self.epoch = int(epoch)
        if self.epoch != self.start_epoch:
            self.start = 0
        self.explicit += 1

    def set_start(self, consumed: int) -> None:
        """Skip the first `consumed` positions of this epoch's global order (mid-epoch resume)."""
        consumed = int(consumed)
        if not 0 <= consumed <= self._length():
            raise UserError(
                f"cannot resume at sample {consumed} of an epoch of {self.dataset_len} samples",
                "the data set changed since the checkpoint; use the same data or checkpoint.resume=none",
            )
        self.start, self.start_epoch = consumed, self.epoch

    def global_order(self) -> torch.Tensor:
        """The whole epoch's order (padded when drop_last=False), identical on every rank and world size."""
        if self.shuffle and self.perm is not None:
            order = self.perm
        elif self.shuffle:
            seed = self.drawn if self.draw_seed and self.drawn is not None else self.seed + self.epoch
            g = torch.Generator().manual_seed(seed)
            order = torch.randperm(self.dataset_len, generator=g)
        else:
            order = torch.arange(self.dataset_len)
        pad = self._length() - self.dataset_len
        if pad:
            order = torch.cat([order, order.repeat(math.ceil(pad / self.dataset_len))[:pad]])
        return order

    def indices(self) -> list[int]:
        """The indices this rank yields this epoch, in order."""
        n = self.num_micro_batches(self.start)
        if self.drop_last:
            end = self.start + n * self.global_batch
        else:
            end = self._length()
        return self.global_order()[self.start + self.rank : end : self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        once = bool(self.on_iter()) if self.on_iter is not None else False
        self._draw()
        if once:  # an evaluation pass (the check said so): every sample once over the ranks, no padding
            return iter(self.global_order()[: self.dataset_len][self.rank :: self.world_size].tolist())
        if self.perm is not None:
            return self._then_draw_again(self.indices())
        return iter(self.indices())

    def _draw(self) -> None:
        """This pass's order drawn as a plain DataLoader's RandomSampler draws it (draw_seed): a seed from torch's
        global stream (kept across a mid-epoch resume), or a permutation from the user's generator (restored
        with the loader's state, so a resumed pass draws it again)."""
        if not (self.draw_seed and self.shuffle):
            return
        if self.generator is not None:
            self.perm = torch.randperm(self.dataset_len, generator=self.generator)
            mark = int((self.perm[:64] * torch.arange(1, 65)[: len(self.perm[:64])]).sum())
        else:
            if not (self.start and self.start_epoch == self.epoch and self.drawn is not None):
                self.drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            mark = self.drawn
        if self.agree is not None:
            self.agree(mark)

    def _then_draw_again(self, indices: list[int]) -> Iterator[int]:
        yield from indices
        # RandomSampler yields a second, empty slice of a permutation once the first is used up: drawn too, so
        # the generator reaches the next pass where the user's own loader leaves it
        torch.randperm(self.dataset_len, generator=self.generator)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_micro_batches(self.start) * self.batch_size
        return max(0, self._length() - self.start) // self.world_size


class ExactEvalSampler(Sampler[int]):
    """Contiguous shards covering every index exactly once over all ranks (sizes differ by at most 1).

    Shards are contiguous and in rank order, so gathering the ranks' results in rank order gives the data
    set's order.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        base, extra = divmod(int(dataset_len), int(world_size))
        self.dataset_len, self.rank, self.world_size = int(dataset_len), int(rank), int(world_size)
        self.begin = rank * base + min(rank, extra)
        self.end = self.begin + base + (1 if rank < extra else 0)

    on_iter: Callable[[], None] | None = None  # a check before each pass (prepare()'s roles)

    def __iter__(self) -> Iterator[int]:
        if self.on_iter is not None:
            self.on_iter()
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin
