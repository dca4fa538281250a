"""ddpkit bench: real trainings through the launcher at each process count; scaling numbers; bad input."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import assert_user_error, run_cli
from ddpkit.cli import main

TINY = ["data.image_size=8", "train.batch_size=16"]  # synthetic 8x8 images, the built-in CNN


@pytest.mark.slow
def test_bench_one_and_two_processes(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    proc = run_cli("bench", "--nproc", "1,2", "--steps", "4", *TINY, "--json", str(js), "--out", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(js.read_text())
    assert doc["dataset"] == "synthetic" and doc["steps_per_epoch"] == 4
    one, two = doc["results"]
    assert [one["nproc"], two["nproc"]] == [1, 2]
    for r in (one, two):
        assert r["global_batch_size"] == 16 * r["nproc"] and r["steps"] == 4
        assert r["images_per_s"] > 0 and r["warmup_images_per_s"] > 0
        # the timed epoch: 4 steps of the global batch in epoch_time_s (rounded in metrics.jsonl)
        assert r["images_per_s"] == pytest.approx(4 * r["global_batch_size"] / r["epoch_time_s"], rel=0.02)
        assert r["backend"] == "gloo" and r["device"] == "cpu"
    assert one["speedup"] == 1.0 and one["efficiency"] == 1.0
    assert two["speedup"] == pytest.approx(two["images_per_s"] / one["images_per_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert (
        one["threads_per_process"] == two["threads_per_process"] == 1
    )  # the tests run with OMP_NUM_THREADS=1
    assert f"| 2 | 1 | 32 | 4 | {two['images_per_s']:.1f} | {two['speedup']:.2f}x |" in proc.stdout
    assert Image.open(png).size == (1000, 450)


def test_an_input_the_child_would_refuse_is_one_line_before_any_progress_line(tmp_path):
    missing = (
        tmp_path / "no-cifar"
    )  # checked as the child `ddpkit train` would, before the first count starts
    args = ["data.dataset=cifar10", f"data.root={missing}", "--json", str(tmp_path / "b.json")]
    proc = run_cli("bench", "--nproc", "1", *args)
    assert_user_error(proc, f"data.root '{missing}' does not exist")
    assert "bench: 1 process(es)" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b.json").exists()


def test_a_failing_child_names_the_count_and_its_error():
    import subprocess

    from ddpkit.commands.bench import _last_error

    proc = subprocess.CompletedProcess(
        [], 2, "", "bench: noise\nddpkit: error: data.root 'x' does not exist\n"
    )
    assert _last_error(proc) == "data.root 'x' does not exist"
    proc = subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: boom\n")
    assert _last_error(proc) == "RuntimeError: boom"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nproc", "1,x"], "is not a list of numbers"),
        (["--nproc", "0,1"], "distinct counts >= 1"),
        (["--nproc", "2,2"], "distinct counts >= 1"),
        (["--nproc", "1", "--steps", "0"], "--steps 0 is not >= 1"),
        (["--nproc", "1", "--steps", "5", "data.dataset=digits"], "--steps sets the epoch length"),
        (["--nproc", "1", "--json", "/nonexistent/b.json"], "does not exist"),
        (["--nproc", "1", "--out", "b.jpg"], "does not end in .png"),
        (["--nproc", "1", "--nproc-per-node", "2"], "launch flags do not apply"),
        (["--nproc", "1", "train.batch_size=-1"], "train.batch_size"),
        (["--steps", "3"], "--nproc"),
    ],
)
def test_bad_input(args, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("ddpkit: error: "), err
    assert fragment in err[0]
