"""Extension points from outside the package: a data set registered through an entry point trains with ddpkit train."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, run_cli
from ddpkit.metrics import read_metrics

PACKAGE = """
import torch
from torch.utils.data import TensorDataset

from ddpkit.data import DatasetEntry, Splits


def build(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    return Splits(TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:]),
                  num_classes=2, in_channels=3, image_size=8)


ENTRY = DatasetEntry("signs", build, label="signs of the mean")
"""


def install(site):
    """mydata, installed as pip would (a dist-info with an entry point), on a folder put on PYTHONPATH."""
    (site / "mydata").mkdir(parents=True)
    (site / "mydata" / "__init__.py").write_text(PACKAGE)
    info = site / "mydata-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mydata\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ddpkit.datasets]\nsigns = mydata:ENTRY\n")


@pytest.mark.slow
def test_a_data_set_from_another_package_trains_with_ddpkit_train(tmp_path):
    install(tmp_path / "site")
    args = [
        "train",
        "data.dataset=signs",
        "train.epochs=2",
        "train.batch_size=16",
        "model.arch=mlp",
        f"out_dir={tmp_path / 'run'}",
        "--nproc-per-node",
        "2",
    ]
    proc = run_cli(*args, env={"PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert (
        [r["epoch"] for r in rows] == [1, 2] and rows[-1]["val_samples"] == 64 and rows[-1]["world_size"] == 2
    )


def test_without_the_package_the_name_is_an_unknown_data_set(tmp_path):
    proc = run_cli("train", "data.dataset=signs", f"out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "unknown data.dataset 'signs'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_docs_example_is_the_tested_package():
    doc = (REPO / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S)[1]
    assert 'DatasetEntry("signs", build' in code and 'signs = "mydata:ENTRY"' in doc
    namespace: dict = {}
    exec(compile(code, "extending.md", "exec"), namespace)  # the doc's package builds the same splits
    splits = namespace["build"](None)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (448, 64, 2)
