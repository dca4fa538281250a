"""The data sets that need no files: scikit-learn's handwritten digits and a learnable synthetic set.

Light to import (the registry lists these entries without torch); the builders import what they need.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ddpkit.data.entry import DatasetEntry, Splits
from ddpkit.errors import UserError

if TYPE_CHECKING:
    from ddpkit.config import Config

DIGITS_TOTAL = 1797
DIGITS_VAL = 359  # prime: no world size 2..4 divides it, so exact evaluation is really exercised
DIGITS_SPLIT_SEED = 0  # the train/val split never depends on cfg.seed


def _digits_file() -> str | None:
    """scikit-learn's own copy of the digits (datasets/data/digits.csv.gz), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def _check_digits(cfg: Config) -> None:
    import importlib.util

    if importlib.util.find_spec("sklearn") is None:
        raise UserError(
            "data.dataset=digits needs scikit-learn, which is not installed",
            "pip install scikit-learn, or choose another data.dataset",
        )


def digits_arrays() -> tuple[Any, Any]:
    """(images N x 8 x 8 in 0..16, labels N): read from scikit-learn's file as its load_digits reads it, without
    importing scikit-learn (0.7 s per process, several seconds under load); load_digits when the file moved."""
    import numpy as np

    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return np.asarray(bunch.images), np.asarray(bunch.target)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _digits(cfg: Config) -> Splits:
    _check_digits(cfg)
    import numpy as np
    import torch

    from ddpkit.data.tensor_sets import TensorImageDataset

    raw_images, raw_labels = digits_arrays()
    images = torch.from_numpy(np.asarray(raw_images, dtype=np.float32) / 16.0).unsqueeze(1)  # N x 1 x 8 x 8
    labels = torch.from_numpy(np.asarray(raw_labels, dtype=np.int64))
    order = torch.from_numpy(np.random.RandomState(DIGITS_SPLIT_SEED).permutation(len(images)))
    val_idx, train_idx = order[:DIGITS_VAL], order[DIGITS_VAL:]
    train_x = images[train_idx]
    mean, std = train_x.mean().item(), train_x.std().item()
    size = cfg.data.image_size or 8
    shift = 1 if cfg.data.augment else 0
    train = TensorImageDataset(train_x, labels[train_idx], mean, std, shift=shift, size=size)
    val = TensorImageDataset(images[val_idx], labels[val_idx], mean, std, size=size)
    return Splits(train, val, num_classes=10, in_channels=1, image_size=size)


def _synthetic(cfg: Config) -> Splits:
    from ddpkit.data.tensor_sets import SyntheticImages

    k = cfg.model.num_classes or 10
    size = cfg.data.image_size or 32
    train = SyntheticImages(cfg.data.synthetic_size, k, size, cfg.seed, 0, augment=cfg.data.augment)
    val = SyntheticImages(cfg.data.synthetic_val_size, k, size, cfg.seed, 1)
    return Splits(train, val, num_classes=k, in_channels=3, image_size=size)


DIGITS = DatasetEntry("digits", _digits, label="digits", check=_check_digits)
SYNTHETIC = DatasetEntry("synthetic", _synthetic, label="synthetic")
ENTRIES = (DIGITS, SYNTHETIC)  # registered by data/registry.py
