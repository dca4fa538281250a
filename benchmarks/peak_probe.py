"""One rank of `benchmarks/memory_per_rank.py --peak`: the Trainer that `ddpkit train` runs, built, then one
optimizer step, then a second; rank 0 writes each rank's peak resident memory after building and after each step, and a
fingerprint of the weights before and after the step (the sum of their squares over every rank's own shards, in
float64), as JSON into the file its first argument names.

    python -m ddpkit run --nproc-per-node 4 benchmarks/peak_probe.py OUT.json KEY=VALUE ...
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit import init_distributed
from ddpkit.config import load_config
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.train.trainer import Trainer


def peak() -> int:
    """This process's peak resident set size so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fingerprint(trainer: Trainer) -> float:
    """The sum of the squares of every weight, each rank's own shards summed over the ranks that hold distinct
    ones (FSDP's shards are disjoint; replicas add the same sum, so it is taken over one replica's ranks)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in trainer.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.detach().double().pow(2).sum()
    if dist.is_initialized() and trainer.strategy.entry.shards == ():  # replicas: each holds the whole
        return float(total)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total)


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config(None, overrides)
    ctx = init_distributed()
    start = peak()
    trainer = Trainer(cfg, ctx)
    built = peak()
    before = fingerprint(trainer)
    trainer.state.begin_epoch(1)
    trainer.runner.begin_epoch(trainer.state.sums)
    trainer.runner.train()
    batches = iter(trainer.train_loader)
    trainer.train_step(itertools.islice(batches, cfg.train.grad_accum_steps))
    stepped = peak()
    after = fingerprint(trainer)
    trainer.train_step(itertools.islice(batches, cfg.train.grad_accum_steps))  # AdamW's moments now held
    stepped2 = peak()
    ranks = {"rank": ctx.rank, "start": start, "built": built, "stepped": stepped, "stepped2": stepped2}
    peaks = all_gather_object(ranks)
    if ctx.is_main:
        params = sum(p.numel() for p in trainer.model.parameters())  # a DTensor's numel is the whole tensor's
        row = {"world_size": ctx.world_size, "ranks": peaks, "params": params}
        row.update(weights_before=before, weights_after=after)
        out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
