"""What a model family is: the model.arch names it owns, a cheap check of a name, and the builder. Every family,
built in or from a package, is one `ModelFamily` in the registry (ddpkit.models)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One kind of model.arch: which names it owns, a cheap check of a name, and the builder."""

    name: str
    owns: Callable[[str], bool]
    build: Callable[[str, int, int, int], nn.Module]  # (arch, num_classes, in_channels, image_size)
    check: Callable[[str], None] = lambda arch: None  # UserError for a name it owns but cannot build
    names: Callable[[], list[str]] = list  # names to suggest for a mistyped arch
    torchvision_weights: bool = False  # model.pretrained=torchvision applies
    # a language model's family: (arch, vocab_size, block_size, cfg.model) -> model; `build` is then unused
    build_lm: Callable[[str, int, int, Any], nn.Module] | None = None

    @property
    def tokens(self) -> bool:
        """Trained on token sequences (data.dataset=text), not on labelled images."""
        return self.build_lm is not None
