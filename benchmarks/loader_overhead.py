"""Samples/s of one process iterating a loader (no model): ddpkit's training loader against a plain DataLoader
over the same data set, with 0 and N workers, the second of two passes timed (persistent workers start once).

    python benchmarks/loader_overhead.py --workers 4 --size 8192 --batch 256
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from ddpkit.data.loaders import distributed_loader
from ddpkit.data.tensor_sets import SyntheticImages


def timed_pass(loader) -> float:
    for _ in loader:  # the first pass starts persistent workers
        pass
    t0 = time.perf_counter()
    n = sum(len(batch[1]) for batch in loader)
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    synthetic = SyntheticImages(args.size, 10, 32, 0, 0)
    t0 = time.perf_counter()
    xs, ys = zip(*(synthetic[i] for i in range(args.size)), strict=True)
    print(f"generate: {args.size / (time.perf_counter() - t0):.0f} samples/s")
    memory = TensorDataset(torch.stack(xs), torch.tensor(ys))
    for name, ds in (("synthetic", synthetic), ("in-memory", memory)):
        for w in (0, args.workers):
            kw = {"num_workers": w, "persistent_workers": w > 0}
            collate = getattr(ds, "ddpkit_collate", None)  # the synthetic set hands over stacked batches
            plain = DataLoader(
                ds, batch_size=args.batch, shuffle=True, drop_last=True, collate_fn=collate, **kw
            )
            ours = distributed_loader(
                ds, args.batch, shuffle=True, drop_last=True, rank=0, world_size=1, **kw
            )
            print(
                f"{name:9s} workers={w}: plain {timed_pass(plain):8.0f}  ddpkit {timed_pass(ours):8.0f} samples/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
