"""glibc's heap in CPU workers: with DDPKIT_MALLOC_TUNE=1 tensors above 1 MiB get pages of their own (returned on
free), unless the user set the allocator's settings (benchmarks/RESULTS.md §11d measures the memory and the speed)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import run_cli
from ddpkit import channels
from ddpkit.distributed import allocator

# A rank frees an 8 MiB tensor (glibc's own rule then serves anything up to 8 MiB from its heap), then makes a
# 2 MiB one: mapped on its own only when the threshold is fixed. mallinfo2's hblkhd: bytes in mmapped blocks.
PROBE = """
import ctypes, json, sys
import torch
from ddpkit import init_distributed
from ddpkit.distributed import allocator

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
ctx = init_distributed()
big = torch.ones(2 << 20)  # 8 MiB
del big
before = libc.mallinfo2().hblkhd
small = torch.ones(1 << 19)  # 2 MiB
mapped = libc.mallinfo2().hblkhd - before >= small.nbytes
with open(f"{sys.argv[1]}.{ctx.rank}", "w") as f:
    json.dump({"applied": allocator.applied(), "mapped": mapped}, f)
"""


def _ranks(out, world_size: int = 2) -> list[dict]:
    return [json.loads(out.with_name(f"{out.name}.{r}").read_text()) for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")
def test_cpu_workers_asked_map_big_tensors_unless_the_user_set_the_allocator(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    asked = {channels.MALLOC_TUNE: "1"}
    runs = {"ours": asked, "theirs": {**asked, "MALLOC_ARENA_MAX": "4"}}
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = pool.map(
            lambda name: run_cli(
                "run", "--nproc-per-node", "2", str(script), str(tmp_path / name), env=runs[name]
            ),
            runs,
        )
        for proc in procs:
            assert proc.returncode == 0, proc.stderr[-2000:]
    assert _ranks(tmp_path / "ours") == [{"applied": 1 << 20, "mapped": True}] * 2
    assert (
        _ranks(tmp_path / "theirs") == [{"applied": None, "mapped": False}] * 2
    )  # glibc's own rule, untouched


@pytest.mark.parametrize(
    "env, why",
    [
        ({}, channels.MALLOC_TUNE),  # not asked for: it costs speed
        ({channels.MALLOC_TUNE: "0"}, channels.MALLOC_TUNE),
        ({channels.MALLOC_TUNE: "1"}, None),
        ({channels.MALLOC_TUNE: "1", "MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({channels.MALLOC_TUNE: "1", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
        ({channels.MALLOC_TUNE: "1", "GLIBC_TUNABLES": "glibc.rtld.nns=2"}, None),
        ({channels.MALLOC_TUNE: "1", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD"),
    ],
)
def test_the_allocator_is_set_only_when_asked_and_the_user_set_nothing(monkeypatch, env, why):
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    for name in (channels.MALLOC_TUNE, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert allocator.user_chose() == why
