"""benchmarks/gpu_check.py builds the commands it runs on a GPU: its dry run on this CPU machine lists every part,
and every `ddpkit train` it would start (its own cases and the comparisons' ddpkit side) has a config that loads.
No GPU and no training here. Budget: 2 s (no processes)."""

from __future__ import annotations

import contextlib
import io
import shlex
import sys

import pytest

from conftest import REPO
from ddpkit.config import load_config


def _benchmark_modules():
    """The three benchmark scripts as modules, imported with benchmarks/ on sys.path only while they load: their
    `_common` is not the examples' `_common`, which later tests in this process import by that name."""
    import importlib

    path, modules = list(sys.path), dict(sys.modules)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return [importlib.import_module(n) for n in ("gpu_check", "launch_bound", "throughput_vs_plain_ddp")]
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - set(modules):
            if name in ("_common", "gpu_check", "launch_bound", "throughput_vs_plain_ddp"):
                del sys.modules[name]


gpu_check, launch_bound, throughput_vs_plain_ddp = _benchmark_modules()


def dry_run(main, *argv: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue().splitlines()


def check_train_config(words: list[str]) -> None:
    """The config of `python -m ddpkit train WORDS...` loads (known keys, valid values)."""
    i = words.index("train")
    rest = words[i + 1 :]
    config = REPO / rest[rest.index("-c") + 1] if "-c" in rest else None
    overrides = [w for w in rest if "=" in w and not w.startswith("-")]
    assert overrides, words
    load_config(str(config) if config else None, overrides)


def test_the_dry_run_builds_every_command(tmp_path):
    lines = dry_run(gpu_check.main, "--out", str(tmp_path), "--dry-run")
    assert not any(tmp_path.iterdir())  # nothing run, nothing written
    by_name = {ln.split(":", 1)[0].split()[1]: shlex.split(ln.split(": ", 1)[1]) for ln in lines}
    assert {"comm_nccl", "digits_fp32", "resnet50_224_bf16_cl", "launch_bound"} <= set(by_name)
    assert {"resnet18_vs_plain_w0", "resnet18_vs_plain_w4"} <= set(by_name)
    # the loader-workers diagnosis: the slow run (one thread) beside 4 threads, no pinning and no workers
    assert by_name["w4_omp1"][0] == "OMP_NUM_THREADS=1" and by_name["w4_omp4"][0] == "OMP_NUM_THREADS=4"
    assert "data.pin_memory=false" in by_name["w4_omp1_nopin"] and "data.num_workers=0" in by_name["w0_omp1"]
    resnet50 = by_name["resnet50_224_bf16_cl"]
    for key in ("model.arch=resnet50", "data.image_size=224", "train.amp=bf16", "model.channels_last=true"):
        assert key in resnet50
    for words in by_name.values():
        if "train" in words and "ddpkit" in words:
            check_train_config(words)
    # the comparisons on CUDA, with 0 and 4 loader workers, each a command its script accepts
    launch = by_name["launch_bound"]
    assert launch[1].endswith("launch_bound.py") and "cuda" in launch
    i = launch.index("--workers")
    assert launch[i + 1 : i + 3] == ["0", "4"]
    sides = dry_run(launch_bound.main, *launch[2:], "--dry-run")
    assert len(sides) == 2 * 2 * 2  # (digits, mlp) x (workers 0, 4) x (ddpkit, plain)
    for line in sides:
        words = shlex.split(line.split(": ", 1)[1])
        if line.startswith("ddpkit"):
            assert "dist.device=cuda" in words
            check_train_config(words)
        else:
            assert words[words.index("--device") + 1] == "cuda"
    for w in ("0", "4"):
        resnet18 = by_name[f"resnet18_vs_plain_w{w}"]
        assert resnet18[resnet18.index("--workers") + 1] == w and "256" in resnet18
        ddpkit_side, plain_side = dry_run(throughput_vs_plain_ddp.main, *resnet18[2:], "--dry-run")
        check_train_config(shlex.split(ddpkit_side.split(": ", 1)[1]))
        assert f"data.num_workers={w}" in ddpkit_side and "--device cuda" in plain_side


def test_a_part_can_be_chosen(tmp_path):
    lines = dry_run(gpu_check.main, "--out", str(tmp_path), "--dry-run", "--parts", "resnet50")
    assert [ln.split(":")[0] for ln in lines] == ["resnet50 resnet50_224_bf16_cl"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--parts", "nothing"])


def test_the_llama1b_part_runs_ddpkit_and_the_handwritten_loop_on_the_same_1b_model(tmp_path):
    import json
    import subprocess

    lines = dry_run(gpu_check.main, "--out", str(tmp_path), "--dry-run", "--parts", "llama1b")
    by_name = {ln.split(":", 1)[0].split()[1]: shlex.split(ln.split(": ", 1)[1]) for ln in lines}
    assert sorted(by_name) == [
        "llama1b_fsdp_bf16",
        "llama1b_fsdp_bf16_compile",
        "llama1b_torch",
        "llama1b_torch_compile",
    ]
    for name in ("llama1b_fsdp_bf16", "llama1b_fsdp_bf16_compile"):
        check_train_config(by_name[name])
        assert {"dist.strategy=fsdp", "train.amp=bf16"} <= set(by_name[name])
    assert "model.compile=true" in by_name["llama1b_fsdp_bf16_compile"]
    assert "--compile" in by_name["llama1b_torch_compile"] and "--compile" not in by_name["llama1b_torch"]
    script = next(w for w in by_name["llama1b_torch"] if w.endswith("llama_fsdp_gpu.py"))
    out = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, check=True)
    assert 0.95e9 < json.loads(out.stdout)["params"] < 1.1e9  # about 1B parameters, on the meta device
