"""The built-in data sets: digits (scikit-learn's file, read without importing it; the fixed split; the
augmentation streams) and synthetic (deterministic, learnable). Budget: 10 s (two small interpreters)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from conftest import cli_env, data_cfg
from ddpkit.data import (
    DataSpec,
    build_datasets,
)

# ---------------------------------------------------------------- digits and synthetic


def test_digits_fixed_split_and_sizes():
    a_train, a_val, spec = build_datasets(data_cfg("digits", augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=1, image_size=8, train_size=1438, val_size=359)
    cfg = data_cfg("digits", augment=False)
    cfg.seed = 1234
    b_train, b_val, _ = build_datasets(cfg)
    assert torch.equal(a_val.images, b_val.images) and torch.equal(a_train.labels, b_train.labels)
    xs = torch.stack([a_train[i][0] for i in range(len(a_train))])
    assert xs.shape == (1438, 1, 8, 8)
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3  # normalised with train stats
    x16, _ = build_datasets(data_cfg("digits", image_size=16))[1][0]
    assert x16.shape == (1, 16, 16)


def test_digits_augmentation_streams():
    train, val, _ = build_datasets(data_cfg("digits", augment=True))

    def stream(seed):
        torch.manual_seed(seed)
        return torch.stack([train[i][0] for i in range(64)])

    assert torch.equal(stream(10), stream(10))
    assert not torch.equal(stream(10), stream(11))  # seed + rank: every rank its own augmentation
    torch.manual_seed(0)
    first = val[0][0]
    torch.manual_seed(1)
    assert torch.equal(first, val[0][0])  # no augmentation on the val set


def test_synthetic_deterministic_and_learnable_shape():
    cfg = data_cfg("synthetic", synthetic_size=300, synthetic_val_size=50, augment=False)
    cfg.seed = 7
    t1, v1, spec = build_datasets(cfg)
    t2, _, _ = build_datasets(cfg)
    assert spec == DataSpec(num_classes=10, in_channels=3, image_size=32, train_size=300, val_size=50)
    for i in (0, 17, 299):
        assert torch.equal(t1[i][0], t2[i][0]) and t1[i][1] == t2[i][1]
    cfg.seed = 8
    t3, _, _ = build_datasets(cfg)
    assert not torch.equal(t1[0][0], t3[0][0])
    # class-dependent: a nearest-class-mean classifier built on train beats chance by far on val
    xs = torch.stack([t1[i][0] for i in range(300)]).flatten(1)
    ys = torch.tensor([t1[i][1] for i in range(300)])
    means = torch.stack([xs[ys == k].mean(0) for k in range(10)])
    vx = torch.stack([v1[i][0] for i in range(50)]).flatten(1)
    vy = torch.tensor([v1[i][1] for i in range(50)])
    assert (torch.cdist(vx, means).argmin(1) == vy).float().mean() > 0.8
    cfg.model.num_classes = 4
    cfg.data.image_size = 12
    _, _, spec4 = build_datasets(cfg)
    assert (spec4.num_classes, spec4.image_size) == (4, 12)


def test_import_stays_light():
    code = "import ddpkit.data, sys; assert 'torchvision' not in sys.modules and 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env(), timeout=120)


def test_digits_come_from_scikit_learns_file_without_importing_it():
    from sklearn.datasets import load_digits

    from ddpkit.data.builtin import digits_arrays

    images, labels = digits_arrays()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    code = (
        "import sys; from ddpkit.data import build_datasets; from ddpkit.config import load_config;"
        "t, v, s = build_datasets(load_config()); assert (len(t), len(v)) == (1438, 359);"
        "assert 'sklearn' not in sys.modules, 'scikit-learn was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=cli_env(), timeout=120)
