"""Undecodable samples (data.skip_corrupt): one line naming the file when met while training, or left out, counted
and named; an undecodable first sample refused before anything is written; the checked data set keeps its face
and travels to loader workers. Budget: 90 s (five short training commands)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, data_cfg, write_imagefolder
from ddpkit.data import (
    build_datasets,
)

# ---------------------------------------------------------------- undecodable samples (data.skip_corrupt)


def damaged_imagefolder(root: Path, train_bad: int = 7) -> tuple[Path, Path]:
    """An image tree (2 classes x 8 images per split) with one garbage training file and one cut-short
    validation PNG; returns their paths."""
    write_imagefolder(root, classes=("ant", "bee"), per_class=8)
    bad_train = root / "train" / "bee" / f"{train_bad}.png"
    bad_train.write_bytes(b"not an image at all")
    bad_val = root / "val" / "ant" / "3.png"
    whole = bad_val.read_bytes()
    bad_val.write_bytes(whole[: len(whole) // 2])
    return bad_train, bad_val


IMAGES = ["data.dataset=imagefolder", "data.image_size=8", "model.arch=mlp", "train.batch_size=4"]


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "report.curves=false", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_an_undecodable_image_met_while_training_is_one_line_naming_the_file(tmp_path, workers):
    bad_train, _ = damaged_imagefolder(tmp_path / "data")
    proc = train_cli(
        f"out_dir={tmp_path / 'run'}",
        f"data.root={tmp_path / 'data'}",
        *IMAGES,
        f"data.num_workers={workers}",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot decode file '{bad_train}' of the training set" in errors[0]
    assert "data.skip_corrupt=true" in errors[0] and "BufferedReader" not in errors[0]


def test_skip_corrupt_leaves_undecodable_samples_out_counts_and_names_them(tmp_path):
    bad_train, bad_val = damaged_imagefolder(tmp_path / "data")
    out = tmp_path / "run"
    proc = train_cli(
        f"out_dir={out}",
        f"data.root={tmp_path / 'data'}",
        *IMAGES,
        "data.num_workers=2",
        "data.skip_corrupt=true",
        "train.epochs=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from ddpkit.train.metrics import read_metrics

    rows = read_metrics(out)
    assert [r["skipped_samples"] for r in rows] == [2, 2]  # one training and one validation file each epoch
    assert [r["val_samples"] for r in rows] == [15, 15]  # scored: the 16 validation images but the bad one
    log = (out / "log.txt").read_text()
    assert (
        log.count("left out 2 undecodable sample(s)") == 2 and str(bad_train) in log and str(bad_val) in log
    )


def test_an_undecodable_first_sample_is_refused_before_anything_is_written(tmp_path):
    damaged_imagefolder(tmp_path / "data", train_bad=0)  # ImageFolder's first sample: the first class's 0.png
    (tmp_path / "data" / "train" / "ant" / "0.png").write_bytes(b"")
    out = tmp_path / "run"
    out.mkdir()
    proc = train_cli(f"out_dir={out}", f"data.root={tmp_path / 'data'}", *IMAGES)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot decode file" in proc.stderr and "ant/0.png" in proc.stderr
    assert list(out.iterdir()) == []  # no config.yaml, no log.txt, no lock file


def test_checked_samples_keep_the_data_sets_face_and_travel_to_workers(tmp_path):
    from ddpkit.data.checked import CheckedSamples, SkipCollate

    bad_train, _ = damaged_imagefolder(tmp_path, train_bad=0)
    train, _, _ = build_datasets(data_cfg("imagefolder", tmp_path, image_size=8, skip_corrupt=True))
    assert isinstance(train, CheckedSamples) and train.classes == ["ant", "bee"]  # the inner set's attributes
    bad = next(i for i, (p, _) in enumerate(train.samples) if p == str(bad_train))
    loader = (
        torch.utils.data.DataLoader(  # a spawned worker: the data set travels pickled, the marks come back
            torch.utils.data.Subset(train, [bad, bad + 1]),
            batch_size=2,
            num_workers=1,
            multiprocessing_context="spawn",
            collate_fn=SkipCollate(train, fill=True),
        )
    )
    (x, y), *_ = list(loader)
    assert x.shape == (1, 3, 8, 8)  # the undecodable sample left out of its batch
    assert train.take_skipped() == [f"file '{bad_train}'"] and train.take_skipped() == []
    x, y = SkipCollate(train, fill=True)([None, None])  # nothing decodable left: one good sample instead
    assert x.shape == (1, 3, 8, 8) and y.shape == (1,)
    x, y = SkipCollate(train, fill=False)([None])  # evaluation: an empty batch, nothing scored twice
    assert x.shape == (0, 3, 8, 8) and y.shape == (0,)
    digits, _, _ = build_datasets(data_cfg("digits", skip_corrupt=True))
    assert not isinstance(digits, CheckedSamples)  # samples in memory: nothing to decode
