"""glibc's heap in a CPU worker: one fixed setting from the start, instead of what the process happened to free.

By default glibc maps each block above 128 KiB on its own and, after the first such block is freed, raises that
size (the dynamic mmap threshold, up to 32 MiB) and the size of free heap top it keeps (the trim threshold, twice
that). So how fast a CPU training step runs depends on what the process freed first: resnet18's optimizer makes
a 9.4 MiB temporary per weight of its last blocks each step, and a worker that never freed a larger block maps,
faults in and unmaps them every step (180,000-350,000 page faults an epoch of 20 steps; 5% of the main thread's
CPU), while a hand-written loop that freed a 31 MiB batch of images while it made its data set reuses them.
ddpkit sets the two thresholds, once per process, when the device is the CPU (`init_distributed`):

- `steady` (the default): glibc's own end state from the start, the mmap threshold at 32 MiB and the trim
  threshold at 64 MiB: a step's temporaries are served again from the heap (benchmarks/RESULTS.md §22b).
- `memory` (DDPKIT_MALLOC_TUNE=1): every tensor above 1 MiB is its own mapping, unmapped on free. A rank's
  resident memory then follows what it holds (the gathered weights, gradients and temporaries of a sharded
  step otherwise stay in the heap, fragmented, §11d), at a cost in speed: every such tensor's pages are faulted
  in afresh (a llama under fsdp on 2 CPU processes, whose activations are 2-6 MiB each, ran at 0.67x).
- `off` (DDPKIT_MALLOC_TUNE=0): glibc's dynamic rule, untouched.

`dist.memory=lean` switches an unset DDPKIT_MALLOC_TUNE to `memory` when the model is sharded (lean_heap).

Never when the user set their allocator's settings themselves (any `MALLOC_*` variable, glibc.malloc tunables, an
LD_PRELOADed allocator), nor off glibc.
"""

from __future__ import annotations

import ctypes
import os

from ddpkit import channels
from ddpkit.errors import UserError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20  # the memory profile's; measured: benchmarks/RESULTS.md §11d
# profile: (mmap threshold, trim threshold); steady is glibc's DEFAULT_MMAP_THRESHOLD_MAX and twice it
PROFILES = {"steady": (32 << 20, 64 << 20), "memory": (MMAP_THRESHOLD_BYTES, 128 << 10)}  # 128 KiB: glibc's
TUNE_VALUES = {"": "steady", "steady": "steady", "1": "memory", "memory": "memory", "0": "off", "off": "off"}
_APPLIED: list[int] = []  # the mmap threshold this process set, once


def profile() -> str:
    """The profile DDPKIT_MALLOC_TUNE asks for: steady (unset), memory (1) or off (0)."""
    raw = os.environ.get(channels.MALLOC_TUNE, "").strip().lower()
    if raw not in TUNE_VALUES:
        raise UserError(
            f"{channels.MALLOC_TUNE}={raw!r} is not a setting of the CPU allocator",
            "unset it (steady), 1 (memory: big tensors returned on free) or 0 (off: glibc's own rule)",
        )
    return TUNE_VALUES[raw]


def user_chose() -> str | None:
    """Why the allocator is left alone in this process (a variable's name), or None when ddpkit sets it: the
    profile is not off and the user set nothing of their own."""
    if profile() == "off":
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


def tune_cpu_allocator() -> int | None:
    """Set glibc's thresholds of the asked profile in this process; the mmap threshold set, or None when this
    process is not glibc's, the profile is off, the user set the allocator, or it was already set."""
    if _APPLIED or user_chose() is not None:
        return None
    return _apply(profile())


def lean_heap() -> int | None:
    """dist.memory=lean in a CPU process: the memory profile from now on, when DDPKIT_MALLOC_TUNE is unset and the
    user set nothing of their own; the mmap threshold set, or None. glibc takes new thresholds at any time; they
    rule the blocks allocated after them."""
    if os.environ.get(channels.MALLOC_TUNE, "").strip() or user_chose() is not None:
        return None
    return _apply("memory")


def _apply(name: str) -> int | None:
    """mallopt the thresholds of profile `name`; the mmap threshold set, or None off glibc or when it refused."""
    libc = _glibc()
    mmap, trim = PROFILES[name]
    if libc is None or libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap)) != 1:
        return None
    libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim))
    _APPLIED[:] = [mmap]
    return mmap


def applied() -> int | None:
    """The mmap threshold ddpkit last set in this process (tune_cpu_allocator, lean_heap), or None."""
    return _APPLIED[0] if _APPLIED else None
