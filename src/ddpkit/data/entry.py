"""A data set's entry (`DatasetEntry`: name, label, on-disk layout, availability check, builder), what its builder
returns (`Splits`) and what the model learns of the data (`DataSpec`). The built-in data sets' modules declare
their entries with these (`ENTRIES`) and import no registry: the registry (registry.py) loads them when first
asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from ddpkit.config import Config


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data: classes, channels, image side, split sizes; for token data
    (a language model's) the vocabulary size and the tokens per sample."""

    num_classes: int
    in_channels: int
    image_size: int
    train_size: int
    val_size: int
    vocab_size: int | None = None
    block_size: int | None = None
    tokenizer: str | None = (
        None  # token data: its tokenizer's JSON text (Hugging Face tokenizers), when known
    )

    @property
    def tokens(self) -> bool:
        """Token sequences (a language model's data), not labelled images."""
        return self.vocab_size is not None


@dataclass(frozen=True)
class Splits:
    """What a builder returns: the train set (augmented when cfg.data.augment), the val set, and their shape."""

    train: Dataset
    val: Dataset
    num_classes: int
    in_channels: int
    image_size: int
    vocab_size: int | None = None  # token data: samples are (ids, next ids) of length data.block_size
    tokenizer: str | None = None  # token data: the tokenizer's JSON text, saved as out_dir/tokenizer.json


@dataclass(frozen=True)
class DatasetEntry:
    """One data set: `build(cfg) -> Splits`; `check(cfg)` looks at files only and raises UserError."""

    name: str
    build: Callable[[Config], Splits]
    label: str = ""
    layout: str = ""  # the on-disk layout under data.root, shown in error messages
    check: Callable[[Config], None] | None = None
    missing: Callable[[str], list[str]] | None = None  # files missing under a root (for download messages)
    downloads: bool = False  # data.download applies: rank 0 downloads while the others wait
    tokens: bool = False  # samples are token sequences for a language model, not images
    preload: tuple[
        str, ...
    ] = ()  # modules a worker imports to build it (the launch's fork server imports them)
    order: int | None = None  # where the registry asks it (lower first; none: in the order registered)

    @property
    def title(self) -> str:
        return self.label or self.name
