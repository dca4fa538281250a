"""Subclasses of torchvision data sets; importing this module imports torchvision (only builders do)."""

from __future__ import annotations

import os
from typing import Any

import torchvision.datasets as tvd
import torchvision.datasets.cifar as tv_cifar

from ddpkit.data import safe_pickle

# torchvision's CIFAR reads its batches with plain pickle.load: from here on, in this process, with ours.
safe_pickle.guard(tv_cifar)


class _PresentFiles:
    """torchvision's CIFAR that checks the files' presence, not their md5 sums (torchvision checks downloads)."""

    base_folder: str
    train_list: list
    test_list: list
    meta: dict
    root: str

    def _check_integrity(self) -> bool:
        return all(
            os.path.isfile(os.path.join(self.root, self.base_folder, f))
            for f, _md5 in self.train_list + self.test_list
        )

    def _load_meta(self) -> None:
        path = os.path.join(self.root, self.base_folder, self.meta["filename"])
        if not os.path.isfile(path):
            raise RuntimeError(f"metadata file {path} not found")
        with open(path, "rb") as fh:
            self.classes = safe_pickle.load(fh, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


class PresentCIFAR10(_PresentFiles, tvd.CIFAR10):
    """CIFAR-10 from data.root, checked by presence."""


class PresentCIFAR100(_PresentFiles, tvd.CIFAR100):
    """CIFAR-100 from data.root, checked by presence."""


class FixedClassImageFolder(tvd.ImageFolder):
    """ImageFolder with a given class -> index mapping (val/ takes train/'s)."""

    def __init__(self, root: str, class_to_idx: dict[str, int], **kwargs: Any) -> None:
        self._fixed_class_to_idx = dict(class_to_idx)
        super().__init__(root, allow_empty=True, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        mapping = self._fixed_class_to_idx
        return sorted(mapping, key=mapping.__getitem__), mapping
