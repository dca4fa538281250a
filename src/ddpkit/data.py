"""Data sets, the global-order distributed sampler, exact evaluation sharding and the loaders built on them.

The training order depends only on (seed, epoch), never on the world size: a permutation of the whole data
set is cut into global micro-batches of `batch_size * world_size`, and rank r takes the r-th slice of each.
So 1 process with batch 2B sees at every step exactly the union of what 2 processes with batch B see, and a
run can stop mid-epoch and resume on any world size without seeing a sample twice.

torchvision and scikit-learn are imported inside functions, so importing this module stays light.
"""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from ddpkit.distributed.comm import derive_seed, get_rank, get_world_size, rank_zero_first
from ddpkit.errors import UserError

if TYPE_CHECKING:
    from ddpkit.config import Config

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2023, 0.1994, 0.2010)
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# torchvision.datasets.folder.IMG_EXTENSIONS, copied so that check_available need not import torchvision.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

DIGITS_TOTAL = 1797
DIGITS_VAL = 359  # prime: no world size 2..4 divides it, so exact evaluation is really exercised
DIGITS_SPLIT_SEED = 0  # the train/val split never depends on cfg.seed

_LABELS = {
    "digits": "digits",
    "synthetic": "synthetic",
    "cifar10": "CIFAR-10",
    "cifar100": "CIFAR-100",
    "mnist": "MNIST",
    "imagefolder": "ImageFolder",
}
_LAYOUT = {
    "cifar10": "cifar-10-batches-py/ with data_batch_1..5, test_batch, batches.meta",
    "cifar100": "cifar-100-python/ with train, test, meta",
    "mnist": "MNIST/raw/ with the four *-idx?-ubyte files",
    "imagefolder": "train/CLASS/IMAGE and val/CLASS/IMAGE",
}
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


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data: classes, channels, image side, split sizes."""

    num_classes: int
    in_channels: int
    image_size: int
    train_size: int
    val_size: int


# --------------------------------------------------------------------------------------------------------
# availability checks (cheap: no data is loaded)
# --------------------------------------------------------------------------------------------------------


def check_available(cfg: Config) -> None:
    """Raise UserError when cfg.data's data set cannot be loaded; looks at files only, loads nothing."""
    name = cfg.data.dataset
    if name == "digits":
        _require_sklearn()
        return
    if name == "synthetic":
        return
    if name not in _LABELS:
        raise UserError(f"unknown data.dataset '{name}'", "choose one of " + ", ".join(_LABELS))
    root = str(cfg.data.root)
    label = _LABELS[name]
    if not root.strip():
        raise UserError(
            f"data.root is empty (data.dataset={name})", f"set data.root to the folder with the {label} files"
        )
    if os.path.exists(root) and not os.path.isdir(root):
        raise UserError(
            f"data.root '{root}' is a file, not a folder (data.dataset={name})",
            f"point data.root at the folder that holds {_LAYOUT[name]}",
        )
    if name == "imagefolder":
        _check_imagefolder(root)
        return
    missing = _missing_files(name, root)
    if not missing or cfg.data.download:
        return
    if not os.path.isdir(root):
        raise UserError(
            f"data.root '{root}' does not exist (data.dataset={name})",
            f"put the {label} files there as {_LAYOUT[name]}, or set data.download=true",
        )
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    raise UserError(
        f"{label} files missing under data.root '{root}': {shown}",
        f"put the files there as {_LAYOUT[name]}, or set data.download=true",
    )


def _require_sklearn() -> None:
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise UserError(
            "data.dataset=digits needs scikit-learn, which is not installed",
            "pip install scikit-learn, or choose another data.dataset",
        ) from None


def _missing_files(name: str, root: str) -> list[str]:
    """Relative paths of the files torchvision would need under root (empty when all are there)."""
    if name in _CIFAR_FILES:
        folder, files = _CIFAR_FILES[name]
        return [f"{folder}/{f}" for f in files if not os.path.isfile(os.path.join(root, folder, f))]
    # MNIST: the raw idx files, or torchvision's legacy processed/training.pt + test.pt
    legacy = os.path.join(root, "MNIST", "processed")
    if all(os.path.isfile(os.path.join(legacy, f)) for f in ("training.pt", "test.pt")):
        return []
    return [
        f"MNIST/raw/{f}" for f in _MNIST_FILES if not os.path.isfile(os.path.join(root, "MNIST", "raw", f))
    ]


def _class_dirs(path: str) -> list[str]:
    with os.scandir(path) as it:
        return sorted(e.name for e in it if e.is_dir())


def _has_image(folder: str) -> bool:
    for _dirpath, _dirs, files in os.walk(folder, followlinks=True):
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return True
    return False


def _check_imagefolder(root: str) -> None:
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


# --------------------------------------------------------------------------------------------------------
# data sets
# --------------------------------------------------------------------------------------------------------


def _random_shift(x: torch.Tensor, pad: int, flip: bool = False) -> torch.Tensor:
    """Zero-pad by `pad` on every side and crop back at a random offset (a random translation); maybe flip."""
    h, w = x.shape[-2:]
    r = torch.randint(0, 2 * pad + 1, (3,)).tolist()
    dy, dx = r[0] - pad, r[1] - pad  # the content moves by (-dy, -dx)
    out = torch.zeros_like(x)
    out[..., max(0, -dy) : h - max(0, dy), max(0, -dx) : w - max(0, dx)] = x[
        ..., max(0, dy) : h - max(0, -dy), max(0, dx) : w - max(0, -dx)
    ]
    if flip and r[2] % 2 == 1:
        out = out.flip(-1)
    return out


class TensorImageDataset(Dataset):
    """In-memory images (N x C x H x W, float in [0, 1]) with labels: optional shift/flip, resize, normalise."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: float,
        std: float,
        *,
        shift: int = 0,
        flip: bool = False,
        size: int | None = None,
    ):
        self.images = images
        self.labels = labels
        self.mean, self.std = float(mean), float(std)
        self.shift, self.flip, self.size = shift, flip, size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index]
        if self.shift:
            x = _random_shift(x, self.shift, self.flip)
        elif self.flip and torch.rand(()).item() < 0.5:
            x = x.flip(-1)
        if self.size and self.size != x.shape[-1]:
            x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        return (x - self.mean) / self.std, int(self.labels[index])


class SyntheticImages(Dataset):
    """A learnable synthetic set: a smooth per-class pattern plus per-index noise, generated on access.

    Everything derives from `seed`: the class patterns (shared by both splits), the labels and each
    image's noise (a generator seeded per (seed, split, index)), so memory stays O(classes + N).
    """

    def __init__(
        self,
        size: int,
        num_classes: int,
        image_size: int,
        seed: int,
        split: int,
        *,
        augment: bool = False,
        noise: float = 1.0,
    ):
        self.n, self.num_classes, self.image_size = int(size), int(num_classes), int(image_size)
        self.seed, self.split, self.noise, self.augment = int(seed), int(split), float(noise), augment
        g = torch.Generator().manual_seed(derive_seed(self.seed, 7001))
        coarse = torch.randn(self.num_classes, 3, 4, 4, generator=g)
        self.patterns = F.interpolate(
            coarse, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
        )
        self.patterns = self.patterns / self.patterns.std()
        g.manual_seed(derive_seed(self.seed, 7002, self.split))
        self.labels = torch.randint(self.num_classes, (self.n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        y = int(self.labels[index])
        g = torch.Generator().manual_seed(derive_seed(self.seed, 7003, self.split, index))
        x = self.patterns[y] + self.noise * torch.randn(3, self.image_size, self.image_size, generator=g)
        if self.augment:
            x = _random_shift(x, max(1, self.image_size // 8), flip=True)
        return x, y


def _digits(cfg: Config) -> tuple[Dataset, Dataset, int, int, int]:
    _require_sklearn()
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32) / 16.0).unsqueeze(1)  # N x 1 x 8 x 8
    labels = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    order = torch.from_numpy(np.random.RandomState(DIGITS_SPLIT_SEED).permutation(len(images)))
    val_idx, train_idx = order[:DIGITS_VAL], order[DIGITS_VAL:]
    train_x = images[train_idx]
    mean, std = train_x.mean().item(), train_x.std().item()
    size = cfg.data.image_size or 8
    aug = cfg.data.augment
    train = TensorImageDataset(train_x, labels[train_idx], mean, std, shift=1 if aug else 0, size=size)
    val = TensorImageDataset(images[val_idx], labels[val_idx], mean, std, size=size)
    return train, val, 10, 1, size


def _synthetic(cfg: Config) -> tuple[Dataset, Dataset, int, int, int]:
    k = cfg.model.num_classes or 10
    size = cfg.data.image_size or 32
    train = SyntheticImages(cfg.data.synthetic_size, k, size, cfg.seed, 0, augment=cfg.data.augment)
    val = SyntheticImages(cfg.data.synthetic_val_size, k, size, cfg.seed, 1)
    return train, val, k, 3, size


def _resize(size: int, native: int) -> list[Any]:
    from torchvision import transforms as T

    return [T.Resize((size, size))] if size != native else []


def _cifar(cfg: Config, download: bool) -> tuple[Dataset, Dataset, int, int, int]:
    from torchvision import transforms as T

    size = cfg.data.image_size or 32
    norm = T.Normalize(CIFAR_MEAN, CIFAR_STD)
    val_tf = T.Compose([*_resize(size, 32), T.ToTensor(), norm])
    train_tf = val_tf
    if cfg.data.augment:
        train_tf = T.Compose(
            [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *_resize(size, 32), T.ToTensor(), norm]
        )
    cls = __getattr__("PresentCIFAR100" if cfg.data.dataset == "cifar100" else "PresentCIFAR10")
    train = cls(cfg.data.root, train=True, transform=train_tf, download=download)
    val = cls(cfg.data.root, train=False, transform=val_tf, download=download)
    return train, val, len(train.classes), 3, size


def _mnist(cfg: Config, download: bool) -> tuple[Dataset, Dataset, int, int, int]:
    from torchvision import transforms as T
    from torchvision.datasets import MNIST

    size = cfg.data.image_size or 28
    norm = T.Normalize(MNIST_MEAN, MNIST_STD)
    val_tf = T.Compose([*_resize(size, 28), T.ToTensor(), norm])
    train_tf = val_tf
    if cfg.data.augment:
        train_tf = T.Compose([T.RandomCrop(28, padding=2), *_resize(size, 28), T.ToTensor(), norm])
    train = MNIST(cfg.data.root, train=True, transform=train_tf, download=download)
    val = MNIST(cfg.data.root, train=False, transform=val_tf, download=download)
    return train, val, len(MNIST.classes), 1, size


def _imagefolder(cfg: Config) -> tuple[Dataset, Dataset, int, int, int]:
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    size = cfg.data.image_size or 224
    norm = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    val_tf = T.Compose([T.Resize(int(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(), norm])
    train_tf = val_tf
    if cfg.data.augment:
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    train = ImageFolder(os.path.join(cfg.data.root, "train"), transform=train_tf)
    # val/ uses train/'s class indices (a class missing from val/ must not shift the others' labels)
    fixed = __getattr__("FixedClassImageFolder")
    val = fixed(os.path.join(cfg.data.root, "val"), train.class_to_idx, transform=val_tf)
    return train, val, len(train.classes), 3, size


def _labels_present(ds: Dataset) -> int:
    """1 + the largest label of a torchvision-style data set (0 when unknown or empty)."""
    targets = getattr(ds, "targets", None)
    if targets is None:
        labels = getattr(ds, "labels", None)
        targets = labels
    if targets is None or len(targets) == 0:
        return 0
    return int(torch.as_tensor(targets).max().item()) + 1


def _load_error(cfg: Config, e: BaseException) -> UserError:
    """A one-line UserError for a failed download or an unreadable file."""
    name, root = cfg.data.dataset, cfg.data.root
    label = _LABELS.get(name, name)
    detail = " ".join(str(e).split())
    detail = f"{type(e).__name__}: " + (detail[:300] + " ..." if len(detail) > 300 else detail)
    if cfg.data.download and name != "imagefolder" and _missing_files(name, root):
        return UserError(
            f"downloading the {label} data into data.root '{root}' failed: {detail}",
            f"check the network, or put the files there yourself as {_LAYOUT[name]} and set data.download=false",
        )
    return UserError(
        f"cannot read the {label} data under data.root '{root}': {detail}",
        f"the files are damaged or not laid out as {_LAYOUT[name]}; replace them",
    )


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset, DataSpec]:
    """(train set, augmented when cfg.data.augment; val set, never augmented; DataSpec) for cfg.data."""
    check_available(cfg)
    name = cfg.data.dataset
    label = _LABELS.get(name, name)
    if name == "digits":
        train, val, k, ch, size = _digits(cfg)
    elif name == "synthetic":
        train, val, k, ch, size = _synthetic(cfg)
    else:
        try:
            if name == "imagefolder":
                train, val, k, ch, size = _imagefolder(cfg)
            elif cfg.data.download:
                with rank_zero_first():  # rank 0 downloads and unpacks, the others wait and then read
                    train, val, k, ch, size = (_mnist if name == "mnist" else _cifar)(cfg, True)
            else:
                train, val, k, ch, size = (_mnist if name == "mnist" else _cifar)(cfg, False)
        except UserError:
            raise
        except (
            OSError,  # includes URLError from a failed download
            RuntimeError,
            ValueError,
            TypeError,
            KeyError,
            EOFError,
            AssertionError,
            pickle.UnpicklingError,
        ) as e:
            raise _load_error(cfg, e) from None
    present = max(k, _labels_present(train), _labels_present(val))
    want = cfg.model.num_classes
    if want is not None and name != "synthetic" and want < present:
        raise UserError(
            f"model.num_classes={want} but the {label} data has {present} classes",
            f"set model.num_classes={present} or leave it unset (null) to take it from the data",
        )
    spec = DataSpec(
        num_classes=present, in_channels=ch, image_size=size, train_size=len(train), val_size=len(val)
    )
    return train, val, spec


# Subclasses of torchvision data sets, made on first use (so importing this module does not import
# torchvision) and reachable as module attributes (so that they pickle, e.g. into spawned workers).
_LAZY_CLASSES: dict[str, type] = {}


def _make_lazy_class(name: str) -> type:
    import torchvision.datasets as tvd

    if name in ("PresentCIFAR10", "PresentCIFAR100"):
        base = tvd.CIFAR100 if name.endswith("100") else tvd.CIFAR10

        def _check_integrity(self: Any) -> bool:
            """Presence only: md5 sums matter for downloads, which torchvision checks on the archive."""
            return all(
                os.path.isfile(os.path.join(self.root, self.base_folder, f))
                for f, _md5 in self.train_list + self.test_list
            )

        def _load_meta(self: Any) -> None:
            path = os.path.join(self.root, self.base_folder, self.meta["filename"])
            if not os.path.isfile(path):
                raise RuntimeError(f"metadata file {path} not found")
            with open(path, "rb") as fh:
                self.classes = pickle.load(fh, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

        body = {"_check_integrity": _check_integrity, "_load_meta": _load_meta}
        doc = f"torchvision's {base.__name__} that checks the files' presence, not their md5 sums."
    elif name == "FixedClassImageFolder":
        base = tvd.ImageFolder

        def __init__(self: Any, root: str, class_to_idx: dict[str, int], **kwargs: Any) -> None:
            self._fixed_class_to_idx = dict(class_to_idx)
            base.__init__(self, root, allow_empty=True, **kwargs)

        def find_classes(self: Any, directory: str) -> tuple[list[str], dict[str, int]]:
            mapping = self._fixed_class_to_idx
            return sorted(mapping, key=mapping.__getitem__), mapping

        body = {"__init__": __init__, "find_classes": find_classes}
        doc = "ImageFolder with a given class -> index mapping (val/ takes train/'s)."
    else:
        raise AttributeError(name)
    cls = type(name, (base,), {"__module__": __name__, "__qualname__": name, "__doc__": doc, **body})
    return cls


def __getattr__(name: str) -> Any:
    if name in ("PresentCIFAR10", "PresentCIFAR100", "FixedClassImageFolder"):
        if name not in _LAZY_CLASSES:
            _LAZY_CLASSES[name] = _make_lazy_class(name)
        return _LAZY_CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------------
# samplers
# --------------------------------------------------------------------------------------------------------


class GlobalOrderSampler(Sampler[int]):
    """This rank's share of one global, world-size-independent order; every rank runs the same step count."""

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        grad_accum_steps: int = 1,
    ):
        if batch_size < 1 or world_size < 1 or grad_accum_steps < 1:
            raise ValueError("batch_size, world_size and grad_accum_steps must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.grad_accum_steps = int(grad_accum_steps)
        self.epoch = 0
        self.start = 0
        step = self.global_batch * self.grad_accum_steps
        if self.dataset_len < step:
            accum = f" x train.grad_accum_steps {self.grad_accum_steps}" if self.grad_accum_steps > 1 else ""
            raise UserError(
                f"the training set has {self.dataset_len} samples, fewer than one optimizer step takes "
                f"(train.batch_size {self.batch_size} x world size {self.world_size}{accum} = {step})",
                "lower train.batch_size"
                + (" or train.grad_accum_steps" if accum else "")
                + ", or use fewer processes",
            )

    @property
    def global_batch(self) -> int:
        """Samples per global micro-batch: batch_size x world_size."""
        return self.batch_size * self.world_size

    def num_micro_batches(self, consumed: int = 0) -> int:
        """Micro-batches every rank runs over the epoch's order after skipping `consumed` samples."""
        n = (self.dataset_len - consumed) // self.global_batch
        return n - n % self.grad_accum_steps

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank in a full epoch."""
        return self.num_micro_batches(0)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order and start it from the beginning."""
        self.epoch = int(epoch)
        self.start = 0

    def set_start(self, consumed: int) -> None:
        """Skip the first `consumed` samples of this epoch's global order (mid-epoch resume)."""
        consumed = int(consumed)
        if not 0 <= consumed <= self.dataset_len:
            raise UserError(
                f"cannot resume at sample {consumed} of an epoch of {self.dataset_len} samples",
                "the data set changed since the checkpoint; use the same data or checkpoint.resume=none",
            )
        self.start = consumed

    def global_order(self) -> torch.Tensor:
        """The whole epoch's order (before skipping), identical on every rank and world size."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch))
        return torch.randperm(self.dataset_len, generator=g)

    def indices(self) -> list[int]:
        """The indices this rank yields this epoch, in order."""
        n = self.num_micro_batches(self.start)
        rest = self.global_order()[self.start : self.start + n * self.global_batch]
        return rest.view(n, self.world_size, self.batch_size)[:, self.rank, :].reshape(-1).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_micro_batches(self.start) * self.batch_size


class ExactEvalSampler(Sampler[int]):
    """Contiguous shards covering every index exactly once over all ranks (sizes differ by at most 1)."""

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        base, extra = divmod(int(dataset_len), int(world_size))
        self.dataset_len, self.rank, self.world_size = int(dataset_len), int(rank), int(world_size)
        self.begin = rank * base + min(rank, extra)
        self.end = self.begin + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin


# --------------------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------------------


def _seed_worker(worker_id: int) -> None:
    """Seed python `random` and numpy in a loader worker from its torch seed (base seed + worker id)."""
    s = torch.initial_seed() % 2**32
    random.seed(s)
    np.random.seed(s)


class DistributedLoader:
    """A DataLoader over a GlobalOrderSampler that calls set_epoch itself and seeds workers per (seed, rank, epoch)."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        grad_accum_steps: int = 1,
        pin_memory: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.num_workers = int(num_workers)
        self.sampler = GlobalOrderSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            rank,
            world_size,
            seed,
            shuffle=shuffle,
            grad_accum_steps=grad_accum_steps,
        )
        self.loader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.sampler,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=pin_memory,
            worker_init_fn=_seed_worker if self.num_workers > 0 else None,
            generator=self._generator(0),
            persistent_workers=self.num_workers > 0,
        )
        self.epoch = 0
        self._start = 0
        self._explicit = 0  # counts set_epoch calls, so a pass only auto-advances when nobody set the epoch

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, self.rank, epoch))

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank in a full epoch."""
        return self.sampler.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch`'s order for the next pass (from its beginning)."""
        self.epoch = int(epoch)
        self._start = 0
        self._explicit += 1

    def set_start(self, consumed: int) -> None:
        """Skip the first `consumed` samples of the current epoch's global order (mid-epoch resume)."""
        self.sampler.set_start(consumed)  # validates
        self._start = int(consumed)

    def __len__(self) -> int:
        return self.sampler.num_micro_batches(self._start)

    def __iter__(self) -> Iterator[Any]:
        epoch, explicit = self.epoch, self._explicit
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(self._start)
        # Worker seeds are drawn from this generator when workers start (with persistent workers: once,
        # at the first pass of this loader).
        self.loader.generator = self._generator(epoch)
        try:
            yield from self.loader
        finally:
            # Also after a pass broken early (the iterator is closed when the loop drops it): the next pass is
            # the next epoch, never a replay of this one's order, unless someone chose the epoch meanwhile.
            if self._explicit == explicit:
                self.epoch = epoch + 1
                self._start = 0


def distributed_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    grad_accum_steps: int = 1,
    pin_memory: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> DistributedLoader:
    """A training loader: this rank's share of the global order, batch_size per process, set_epoch automatic."""
    return DistributedLoader(
        dataset,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        num_workers=num_workers,
        grad_accum_steps=grad_accum_steps,
        pin_memory=pin_memory,
        rank=get_rank() if rank is None else rank,
        world_size=get_world_size() if world_size is None else world_size,
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> DataLoader:
    """An evaluation loader: every sample exactly once over all ranks (no padding, no duplicates)."""
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ExactEvalSampler(len(dataset), rank, world_size),  # type: ignore[arg-type]
        drop_last=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


def build_loaders(
    cfg: Config, rank: int, world_size: int, train_ds: Dataset, val_ds: Dataset
) -> tuple[DistributedLoader, DataLoader]:
    """The trainer's (train, val) loaders from cfg.train, cfg.eval, cfg.data and cfg.seed."""
    pin = bool(cfg.data.pin_memory) and torch.cuda.is_available()
    train = DistributedLoader(
        train_ds,
        cfg.train.batch_size,
        shuffle=True,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        grad_accum_steps=cfg.train.grad_accum_steps,
        pin_memory=pin,
        rank=rank,
        world_size=world_size,
    )
    val = eval_loader(
        val_ds,
        cfg.eval.batch_size or cfg.train.batch_size,
        num_workers=cfg.data.num_workers,
        pin_memory=pin,
        rank=rank,
        world_size=world_size,
    )
    return train, val
