"""glibc's heap in CPU workers: by default its thresholds fixed at glibc's own end state (a step's temporaries up to
32 MiB reused from the heap), with DDPKIT_MALLOC_TUNE=1 tensors above 1 MiB get pages of their own (returned on
free), with 0 glibc's dynamic rule; never when the user set the allocator's settings (benchmarks/RESULTS.md §11d
and §22b measure the memory and the speed)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import run_cli
from ddpkit import channels
from ddpkit.distributed import allocator

# A rank frees an 8 MiB tensor (glibc's own rule then serves anything up to 8 MiB from its heap), then makes a
# 2 MiB one (mapped on its own only with the memory profile) and a 30 MiB one (mapped unless the steady profile
# serves it from the heap; mapped whatever the profile if the heap had no 30 MiB free: fordblks, checked).
# mallinfo2's hblkhd: bytes in mmapped blocks.
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
mapped = []
for numel in (1 << 19, 30 << 18):  # 2 MiB, 30 MiB
    before = libc.mallinfo2()
    t = torch.ones(numel)
    mapped.append(libc.mallinfo2().hblkhd - before.hblkhd >= t.nbytes)
    del t
room = before.fordblks >= 30 << 20  # the heap could have served the 30 MiB one whatever the threshold
with open(f"{sys.argv[1]}.{ctx.rank}", "w") as f:
    json.dump({"applied": allocator.applied(), "mapped": mapped, "room": room}, f)
"""


def _ranks(out, world_size: int = 2) -> list[dict]:
    return [json.loads(out.with_name(f"{out.name}.{r}").read_text()) for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")
def test_cpu_workers_get_the_profile_asked_for_unless_the_user_set_the_allocator(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    runs = {  # name: (environment, processes)
        "steady": ({}, 2),
        "memory": ({channels.MALLOC_TUNE: "1"}, 2),
        "off": ({channels.MALLOC_TUNE: "0"}, 1),
        "theirs": ({"MALLOC_ARENA_MAX": "4"}, 1),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = pool.map(
            lambda name: run_cli(
                "run",
                "--nproc-per-node",
                str(runs[name][1]),
                str(script),
                str(tmp_path / name),
                env=runs[name][0],
            ),
            runs,
        )
        for proc in procs:
            assert proc.returncode == 0, proc.stderr[-2000:]
    no_room = {"room": False}
    assert _ranks(tmp_path / "steady") == [{"applied": 32 << 20, "mapped": [False, False], **no_room}] * 2
    assert [r["applied"] for r in _ranks(tmp_path / "memory")] == [1 << 20] * 2
    assert [r["mapped"][0] for r in _ranks(tmp_path / "memory")] == [True] * 2
    for untouched in ("off", "theirs"):  # glibc's own rule: the 30 MiB tensor is above its raised threshold
        assert _ranks(tmp_path / untouched, 1) == [{"applied": None, "mapped": [False, True], **no_room}]


def test_a_malloc_setting_that_is_none_is_one_line(tmp_path):
    proc = run_cli("run", str(tmp_path / "absent.py"), env={channels.MALLOC_TUNE: "fast"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "ddpkit: error: DDPKIT_MALLOC_TUNE='fast' is not a setting of the CPU allocator" in proc.stderr


@pytest.mark.parametrize(
    "env, why",
    [
        ({}, None),  # the steady profile
        ({channels.MALLOC_TUNE: "0"}, channels.MALLOC_TUNE),
        ({channels.MALLOC_TUNE: "1"}, None),
        ({channels.MALLOC_TUNE: "1", "MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({channels.MALLOC_TUNE: "1", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
        ({channels.MALLOC_TUNE: "1", "GLIBC_TUNABLES": "glibc.rtld.nns=2"}, None),
        ({channels.MALLOC_TUNE: "1", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD"),
    ],
)
def test_the_allocator_is_left_alone_when_off_or_the_user_set_it(monkeypatch, env, why):
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    for name in (channels.MALLOC_TUNE, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert allocator.user_chose() == why


LEAN = """
import json, sys
from ddpkit.distributed import allocator
print(json.dumps([allocator.tune_cpu_allocator(), allocator.lean_heap(), allocator.applied()]))
"""


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc only")
@pytest.mark.parametrize(
    "env, want",
    [
        ({}, [32 << 20, 1 << 20, 1 << 20]),  # dist.memory=lean: the memory profile from the sharding on
        ({channels.MALLOC_TUNE: "steady"}, [32 << 20, None, 32 << 20]),  # the user's word stands
        ({channels.MALLOC_TUNE: "0"}, [None, None, None]),
        ({"MALLOC_ARENA_MAX": "2"}, [None, None, None]),  # the user set glibc's heap themselves
    ],
)
def test_lean_memory_takes_the_memory_heap_unless_the_user_chose_one(env, want):
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != channels.MALLOC_TUNE}
    proc = subprocess.run(
        [sys.executable, "-c", LEAN], env={**base, **env}, capture_output=True, text=True, check=True
    )
    assert json.loads(proc.stdout) == want
