"""The image data sets on their real on-disk formats (CIFAR-10/100 pickled batches, MNIST idx files, an image
folder of PNGs) through build_datasets, the availability checks made before anything starts, damaged files as one
line, and the download path in a real process group. Budget: 40 s (one group of 2 processes)."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from conftest import data_cfg, run_group, write_cifar10, write_cifar100, write_imagefolder
from ddpkit.data import (
    CIFAR_MEAN,
    CIFAR_STD,
    DataSpec,
    build_datasets,
    check_available,
)
from ddpkit.errors import UserError

# ---------------------------------------------------------------- writers of the real on-disk formats


def write_mnist(root, train: int = 10, test: int = 4) -> None:
    d = root / "MNIST" / "raw"
    d.mkdir(parents=True)
    for prefix, n in (("train", train), ("t10k", test)):
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        for i in range(n):
            images[i] = 20 * i
        labels = np.arange(n, dtype=np.uint8) % 10
        (d / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes()
        )
        (d / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


# ---------------------------------------------------------------- data sets through build_datasets


def test_cifar10_real_pickled_batches(tmp_path):
    write_cifar10(tmp_path, per_batch=4, test=6)
    train, val, spec = build_datasets(data_cfg("cifar10", tmp_path, augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=3, image_size=32, train_size=20, val_size=6)
    x, y = val[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 3
    for c in range(3):
        expected = ((30 + c) / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]
        assert torch.allclose(x[c], torch.full((32, 32), expected), atol=1e-5)
    assert [train[i][1] for i in range(20)] == [i % 10 for i in range(20)]
    # augmentation: random crop with zero padding changes border pixels for some seeds; same seed, same output
    aug, _, _ = build_datasets(data_cfg("cifar10", tmp_path, augment=True))
    torch.manual_seed(1)
    a = torch.stack([aug[5][0] for _ in range(8)])
    torch.manual_seed(1)
    b = torch.stack([aug[5][0] for _ in range(8)])
    assert torch.equal(a, b) and not all(torch.equal(a[0], a[i]) for i in range(8))
    pickle.loads(pickle.dumps(train))  # workers started with spawn need to pickle the data set


def test_cifar100_fine_labels_and_100_classes(tmp_path):
    write_cifar100(tmp_path, train=12, test=5)
    train, val, spec = build_datasets(data_cfg("cifar100", tmp_path, augment=False))
    assert spec.num_classes == 100 and (spec.train_size, spec.val_size) == (12, 5)
    assert [train[i][1] for i in range(12)] == [(7 * i) % 100 for i in range(12)]
    assert val[0][0].shape == (3, 32, 32)
    cfg = data_cfg("cifar100", tmp_path)
    cfg.model.num_classes = 10
    with pytest.raises(UserError, match=r"model\.num_classes=10 .* 100 classes"):
        build_datasets(cfg)


def test_mnist_idx_files(tmp_path):
    write_mnist(tmp_path, train=10, test=4)
    train, val, spec = build_datasets(data_cfg("mnist", tmp_path, augment=False))
    assert spec == DataSpec(num_classes=10, in_channels=1, image_size=28, train_size=10, val_size=4)
    x, y = val[2]
    assert x.shape == (1, 28, 28) and y == 2
    assert torch.allclose(x, torch.full((1, 28, 28), (40 / 255 - 0.1307) / 0.3081), atol=1e-5)
    _, _, spec16 = build_datasets(data_cfg("mnist", tmp_path, image_size=16))
    assert spec16.image_size == 16


def test_imagefolder_png_tree(tmp_path):
    write_imagefolder(
        tmp_path, per_class=3, val_classes=("ant", "cat")
    )  # val lacks a class: labels must not shift
    train, val, spec = build_datasets(data_cfg("imagefolder", tmp_path, image_size=16))
    assert spec == DataSpec(num_classes=3, in_channels=3, image_size=16, train_size=9, val_size=6)
    assert sorted({train[i][1] for i in range(9)}) == [0, 1, 2]
    assert [val[i][1] for i in range(6)] == [0, 0, 0, 2, 2, 2]
    x, _ = val[0]
    assert x.shape == (3, 16, 16)
    blue = (200 / 255 - 0.406) / 0.225  # every image's blue channel is 200
    assert torch.allclose(x[2], torch.full((16, 16), blue), atol=1e-3)
    pickle.loads(pickle.dumps(val))
    cfg = data_cfg("imagefolder", tmp_path, image_size=16)
    cfg.model.num_classes = 2
    with pytest.raises(UserError, match=r"model\.num_classes"):
        build_datasets(cfg)


# ---------------------------------------------------------------- check_available


def _err(cfg) -> str:
    with pytest.raises(UserError) as e:
        check_available(cfg)
    return str(e.value)


def test_check_available_errors(tmp_path):
    msg = _err(data_cfg("cifar10", tmp_path / "nope"))
    assert "data.root" in msg and "does not exist" in msg and "data.download=true" in msg
    (tmp_path / "afile").write_text("x")
    assert "is a file" in _err(data_cfg("mnist", tmp_path / "afile"))
    write_cifar10(tmp_path / "c")
    os.remove(tmp_path / "c" / "cifar-10-batches-py" / "data_batch_3")
    msg = _err(data_cfg("cifar10", tmp_path / "c"))
    assert "data_batch_3" in msg and "data.root" in msg and "data.download=true" in msg
    check_available(data_cfg("cifar10", tmp_path / "c", download=True))  # download would fetch them
    msg = _err(data_cfg("cifar100", tmp_path / "c"))
    assert "cifar-100-python/train" in msg
    (tmp_path / "m" / "MNIST" / "raw").mkdir(parents=True)
    assert "t10k-labels-idx1-ubyte" in _err(data_cfg("mnist", tmp_path / "m"))
    for name in ("digits", "synthetic"):
        check_available(data_cfg(name, tmp_path / "nope"))


def test_check_available_imagefolder(tmp_path):
    assert "does not exist" in _err(data_cfg("imagefolder", tmp_path / "nope"))
    write_imagefolder(tmp_path / "a")
    check_available(data_cfg("imagefolder", tmp_path / "a"))
    import shutil

    shutil.rmtree(tmp_path / "a" / "val")
    msg = _err(data_cfg("imagefolder", tmp_path / "a"))
    assert "data.root" in msg and "val/" in msg
    (tmp_path / "b" / "train").mkdir(parents=True)
    (tmp_path / "b" / "val").mkdir()
    assert "no class folders" in _err(data_cfg("imagefolder", tmp_path / "b"))
    for split in ("train", "val"):
        (tmp_path / "b" / split / "dog").mkdir()
        (tmp_path / "b" / split / "dog" / "notes.txt").write_text("not an image")
    msg = _err(data_cfg("imagefolder", tmp_path / "b"))
    assert "without images" in msg and "dog" in msg
    write_imagefolder(tmp_path / "c", classes=("ant",), val_classes=("ant", "zebra"))
    assert "zebra" in _err(data_cfg("imagefolder", tmp_path / "c"))


def test_build_datasets_checks_first(tmp_path):
    with pytest.raises(UserError, match="data.root"):
        build_datasets(data_cfg("cifar10", tmp_path / "missing"))


def test_damaged_files_are_one_line_user_errors(tmp_path):
    write_cifar10(tmp_path / "c")
    (tmp_path / "c" / "cifar-10-batches-py" / "data_batch_2").write_bytes(b"not a pickle\n\x00")
    write_mnist(tmp_path / "m")
    (tmp_path / "m" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").write_bytes(
        struct.pack(">I", 2051) + b"\x01"
    )
    for name, root in (("cifar10", tmp_path / "c"), ("mnist", tmp_path / "m")):
        with pytest.raises(UserError) as e:
            build_datasets(data_cfg(name, root))
        assert "cannot read" in str(e.value) and "data.root" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- a real process group


def _download_group(rank: int, world_size: int, root: str):
    cfg = data_cfg("cifar10", root, download=True, augment=False)
    train, val, spec = build_datasets(cfg)  # files present: rank 0 "downloads" (a no-op) first, then the rest
    return spec.train_size, spec.val_size


@pytest.mark.slow
def test_download_path_in_a_process_group(tmp_path):
    write_cifar10(tmp_path, per_batch=2, test=3)
    assert run_group(_download_group, 2, str(tmp_path)) == [(10, 3), (10, 3)]
