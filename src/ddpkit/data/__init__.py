"""Data: the data set registry and its entries, the distributed samplers, and the loaders built on them.

Names load on first use (PEP 562), so `import ddpkit.data.registry` stays light; torchvision and scikit-learn
are imported only by the builders that need them.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DataSpec": "entry",
    "DatasetEntry": "entry",
    "Splits": "entry",
    "build_datasets": "registry",
    "check_available": "registry",
    "dataset_names": "registry",
    "get_dataset": "registry",
    "register_dataset": "registry",
    "GlobalOrderSampler": "sampler",
    "ExactEvalSampler": "sampler",
    "CheckedSamples": "checked",
    "CorruptSample": "checked",
    "check_decodable": "checked",
    "skipped_in_epoch": "checked",
    "DistributedLoader": "loaders",
    "build_loaders": "loaders",
    "convert_loader": "loaders",
    "distributed_loader": "loaders",
    "eval_loader": "loaders",
    "SyntheticImages": "tensor_sets",
    "TensorImageDataset": "tensor_sets",
    "CIFAR_MEAN": "vision",
    "CIFAR_STD": "vision",
    "IMAGENET_MEAN": "vision",
    "IMAGENET_STD": "vision",
    "MNIST_MEAN": "vision",
    "MNIST_STD": "vision",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"ddpkit.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ddpkit.data' has no attribute {name!r}")


__all__ = sorted(_WHERE)
