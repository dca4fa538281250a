"""glibc's heap in a CPU worker: tensors above a fixed size get pages of their own, returned when freed.

By default glibc serves a freed block again from its heap and raises the size it maps on its own (the dynamic
mmap threshold) up to 32 MiB after the first such block is freed: the gathered weights, gradients and
temporaries of a training step (1-32 MiB each for a model of a few hundred million parameters) then stay in the
heap after they are freed, fragmented, and a rank's resident memory grows well beyond what it holds
(benchmarks/RESULTS.md §11d). With a fixed threshold (mallopt M_MMAP_THRESHOLD) every tensor above it is its own
mapping, unmapped on free.

It costs speed: every such tensor's pages are faulted in afresh (a llama under fsdp on 2 CPU processes, whose
activations are 2-6 MiB each, ran at 0.67x of its speed), so it is asked for: DDPKIT_MALLOC_TUNE=1 makes
`init_distributed` apply it once per process when the device is the CPU, the C library is glibc and malloc is its
own; never when the user set their allocator's settings themselves (any `MALLOC_*` variable, glibc.malloc
tunables, an LD_PRELOADed allocator).
"""

from __future__ import annotations

import ctypes
import os

from ddpkit import channels

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20  # measured: benchmarks/RESULTS.md §11d
_APPLIED: list[int] = []  # the threshold this process set, once


def user_chose() -> str | None:
    """Why the allocator is left alone in this process (a variable's name), or None when it is asked for
    (DDPKIT_MALLOC_TUNE=1) and the user set nothing of their own."""
    if os.environ.get(channels.MALLOC_TUNE, "0") != "1":
        return channels.MALLOC_TUNE
    for name in sorted(os.environ):
        if name.startswith("MALLOC_"):
            return name
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc, tcmalloc, mimalloc: not glibc's heap
        return "LD_PRELOAD"
    return None


def _glibc():
    """The running C library when it is glibc (it has gnu_get_libc_version and mallopt), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version, libc.mallopt  # noqa: B018 - AttributeError when absent
    except (OSError, AttributeError):
        return None
    return libc


def tune_cpu_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> int | None:
    """Fix glibc's mmap threshold at `threshold` bytes in this process; the threshold set, or None when this
    process is not glibc's, it was not asked for, the user set the allocator, or it was already set."""
    if _APPLIED or user_chose() is not None:
        return None
    libc = _glibc()
    if libc is None or libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        return None
    _APPLIED.append(threshold)
    return threshold


def applied() -> int | None:
    """The mmap threshold tune_cpu_allocator set in this process, or None."""
    return _APPLIED[0] if _APPLIED else None
