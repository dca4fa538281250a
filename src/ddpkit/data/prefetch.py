"""Micro-batches on the device before they are needed: on CUDA the next batch's copy (from pinned host memory,
non-blocking) runs on a side stream while the current one computes; elsewhere each batch is moved as it comes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_END = object()


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device, channels_last: bool = False):
    """A micro-batch on `device` (channels_last for 4-d images when asked); non-blocking copies on CUDA."""
    non_blocking = device.type == "cuda"
    x = x.to(device, non_blocking=non_blocking)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(device, non_blocking=non_blocking)


class DeviceBatches:
    """Moves an iterable of (x, y) batches to `device`; `ahead` (default: on CUDA) keeps the next batch's copy in
    flight on a side stream while the current batch computes.

    Called with the loader's batches, it returns an iterator of device batches (DistributedLoader.move takes it:
    the loader counts a batch as consumed when it is handed over, not when it is drawn ahead). Without CUDA the
    side stream is none and `ahead` only draws one batch early (the path a CPU test takes).
    """

    def __init__(self, device: torch.device, channels_last: bool = False, ahead: bool | None = None):
        self.device, self.channels_last = device, channels_last
        self.ahead = device.type == "cuda" if ahead is None else ahead
        self.stream = torch.cuda.Stream(device) if self.ahead and device.type == "cuda" else None

    def _move(self, batch: Any) -> Any:
        x, y = batch
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return to_device(x, y, self.device, self.channels_last)

    def _ready(self, batch: Any) -> Any:
        """A batch whose copy ran on the side stream, safe to use on the current stream."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in batch:
                t.record_stream(current)  # its memory is not reused before the current stream is done with it
        return batch

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        it = iter(batches)
        if not self.ahead:
            for batch in it:
                yield self._move(batch)
            return
        following = next(it, _END)
        pending = self._move(following) if following is not _END else _END
        while pending is not _END:
            current = pending
            following = next(it, _END)
            pending = self._move(following) if following is not _END else _END  # in flight while we compute
            yield self._ready(current)
