"""The torchvision-backed data sets: CIFAR-10/100, MNIST and ImageFolder, read from data.root.

The availability checks look at files only and import nothing heavy; torchvision is imported by the builders.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ddpkit.data.entry import DatasetEntry, Splits
from ddpkit.errors import UserError

if TYPE_CHECKING:
    from ddpkit.config import Config

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2023, 0.1994, 0.2010)
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# torchvision.datasets.folder.IMG_EXTENSIONS, copied so that the checks need not import torchvision.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_CIFAR_FILES = {
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"],
    ),
    "cifar100": ("cifar-100-python", ["train", "test", "meta"]),
}
_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# ----------------------------------------------------------------------------------------------- checks


def _cifar_missing(name: str):
    def missing(root: str) -> list[str]:
        folder, files = _CIFAR_FILES[name]
        return [f"{folder}/{f}" for f in files if not os.path.isfile(os.path.join(root, folder, f))]

    return missing


def _mnist_missing(root: str) -> list[str]:
    """The raw idx files, or torchvision's legacy processed/training.pt + test.pt."""
    legacy = os.path.join(root, "MNIST", "processed")
    if all(os.path.isfile(os.path.join(legacy, f)) for f in ("training.pt", "test.pt")):
        return []
    raw = os.path.join(root, "MNIST", "raw")
    return [f"MNIST/raw/{f}" for f in _MNIST_FILES if not os.path.isfile(os.path.join(raw, f))]


def _check_root(cfg: Config, entry: DatasetEntry) -> str:
    root = str(cfg.data.root)
    if not root.strip():
        raise UserError(
            f"data.root is empty (data.dataset={entry.name})",
            f"set data.root to the folder with the {entry.title} files",
        )
    if os.path.exists(root) and not os.path.isdir(root):
        raise UserError(
            f"data.root '{root}' is a file, not a folder (data.dataset={entry.name})",
            f"point data.root at the folder that holds {entry.layout}",
        )
    return root


def _check_files(entry_name: str):
    def check(cfg: Config) -> None:
        entry = _ENTRIES[entry_name]
        root = _check_root(cfg, entry)
        missing = entry.missing(root) if entry.missing else []
        if not missing or cfg.data.download:
            return
        if not os.path.isdir(root):
            raise UserError(
                f"data.root '{root}' does not exist (data.dataset={entry.name})",
                f"put the {entry.title} files there as {entry.layout}, or set data.download=true",
            )
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UserError(
            f"{entry.title} files missing under data.root '{root}': {shown}",
            f"put the files there as {entry.layout}, or set data.download=true",
        )

    return check


def _class_dirs(path: str) -> list[str]:
    with os.scandir(path) as it:
        return sorted(e.name for e in it if e.is_dir())


def _has_image(folder: str) -> bool:
    for _dirpath, _dirs, files in os.walk(folder, followlinks=True):
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return True
    return False


def _check_imagefolder(cfg: Config) -> None:
    root = _check_root(cfg, _ENTRIES["imagefolder"])
    layout = f"{root}/train/CLASS/IMAGE and {root}/val/CLASS/IMAGE"
    if not os.path.isdir(root):
        raise UserError(f"data.root '{root}' does not exist (data.dataset=imagefolder)", f"create {layout}")
    classes: dict[str, list[str]] = {}
    for split in ("train", "val"):
        d = os.path.join(root, split)
        if not os.path.isdir(d):
            raise UserError(
                f"data.root '{root}' has no {split}/ folder (data.dataset=imagefolder)",
                f"data.dataset=imagefolder needs {layout}",
            )
        classes[split] = _class_dirs(d)
        if not classes[split]:
            raise UserError(
                f"data.root '{root}/{split}' has no class folders (data.dataset=imagefolder)",
                f"put each class's images in its own folder: {layout}",
            )
    empty = [c for c in classes["train"] if not _has_image(os.path.join(root, "train", c))]
    if empty:
        shown = ", ".join(empty[:5]) + (" ..." if len(empty) > 5 else "")
        raise UserError(
            f"data.root '{root}/train' has class folders without images: {shown}",
            f"add {'/'.join(IMG_EXTENSIONS[:3])}... images to every class folder or remove the empty ones",
        )
    extra = sorted(set(classes["val"]) - set(classes["train"]))
    if extra:
        raise UserError(
            f"data.root '{root}/val' has classes that train/ lacks: {', '.join(extra[:5])}",
            "val/ must use the class folder names of train/",
        )
    if not any(_has_image(os.path.join(root, "val", c)) for c in classes["val"]):
        raise UserError(
            f"data.root '{root}/val' has no images (data.dataset=imagefolder)",
            f"add validation images: {layout}",
        )


# ----------------------------------------------------------------------------------------------- builders


def _small_image_transforms(
    cfg: Config, native: int, mean: Any, std: Any, augment: list[Any]
) -> tuple[int, Any, Any]:
    """(image size, train transform, val transform) of a small-image set: `augment` (at the native size) first
    when data.augment, then a resize when data.image_size differs from `native`, tensor, normalisation."""
    from torchvision import transforms as T

    size = cfg.data.image_size or native
    tail = [*([T.Resize((size, size))] if size != native else []), T.ToTensor(), T.Normalize(mean, std)]
    val_tf = T.Compose(tail)
    train_tf = T.Compose([*augment, *tail]) if cfg.data.augment else val_tf
    return size, train_tf, val_tf


def _cifar(cfg: Config) -> Splits:
    from torchvision import transforms as T

    from ddpkit.data.tv_classes import PresentCIFAR10, PresentCIFAR100

    augment = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    size, train_tf, val_tf = _small_image_transforms(cfg, 32, CIFAR_MEAN, CIFAR_STD, augment)
    cls = PresentCIFAR100 if cfg.data.dataset == "cifar100" else PresentCIFAR10
    download = cfg.data.download
    train = cls(cfg.data.root, train=True, transform=train_tf, download=download)
    val = cls(cfg.data.root, train=False, transform=val_tf, download=download)
    return Splits(train, val, num_classes=len(train.classes), in_channels=3, image_size=size)


def _mnist(cfg: Config) -> Splits:
    from torchvision import transforms as T
    from torchvision.datasets import MNIST

    augment = [T.RandomCrop(28, padding=2)]
    size, train_tf, val_tf = _small_image_transforms(cfg, 28, MNIST_MEAN, MNIST_STD, augment)
    download = cfg.data.download
    train = MNIST(cfg.data.root, train=True, transform=train_tf, download=download)
    val = MNIST(cfg.data.root, train=False, transform=val_tf, download=download)
    return Splits(train, val, num_classes=len(MNIST.classes), in_channels=1, image_size=size)


def _imagefolder(cfg: Config) -> Splits:
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    from ddpkit.data.tv_classes import FixedClassImageFolder

    size = cfg.data.image_size or 224
    norm = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    val_tf = T.Compose([T.Resize(int(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(), norm])
    train_tf = val_tf
    if cfg.data.augment:
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    train = ImageFolder(os.path.join(cfg.data.root, "train"), transform=train_tf)
    # val/ uses train/'s class indices (a class missing from val/ must not shift the others' labels)
    val = FixedClassImageFolder(os.path.join(cfg.data.root, "val"), train.class_to_idx, transform=val_tf)
    return Splits(train, val, num_classes=len(train.classes), in_channels=3, image_size=size)


_ENTRIES = {
    e.name: e
    for e in (
        DatasetEntry(
            "cifar10",
            _cifar,
            label="CIFAR-10",
            layout="cifar-10-batches-py/ with data_batch_1..5, test_batch, batches.meta",
            check=_check_files("cifar10"),
            missing=_cifar_missing("cifar10"),
            downloads=True,
            preload=("torchvision",),
        ),
        DatasetEntry(
            "cifar100",
            _cifar,
            label="CIFAR-100",
            layout="cifar-100-python/ with train, test, meta",
            check=_check_files("cifar100"),
            missing=_cifar_missing("cifar100"),
            downloads=True,
            preload=("torchvision",),
        ),
        DatasetEntry(
            "mnist",
            _mnist,
            label="MNIST",
            layout="MNIST/raw/ with the four *-idx?-ubyte files",
            check=_check_files("mnist"),
            missing=_mnist_missing,
            downloads=True,
            preload=("torchvision",),
        ),
        DatasetEntry(
            "imagefolder",
            _imagefolder,
            label="ImageFolder",
            layout="train/CLASS/IMAGE and val/CLASS/IMAGE",
            check=_check_imagefolder,
            preload=("torchvision",),
        ),
    )
}
ENTRIES = tuple(_ENTRIES.values())  # registered by data/registry.py
