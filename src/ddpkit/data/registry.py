"""The data set registry: one entry per data set (name, label, on-disk layout, availability check, builder).

Adding a data set is one `DatasetEntry` (entry.py) passed to `register_dataset`, from a package of your own (or an
entry point in the `ddpkit.datasets` group, loaded when its name is first asked for), or one more entry in the
`ENTRIES` of a built-in module, loaded when the registry is first used (`_builtin_entries`; the built-in modules
import no registry). Importing the registry imports no torch, so the config can check a data set's name
cheaply.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from ddpkit.config.declared import check_with
from ddpkit.data import builtin, safe_pickle, text, vision
from ddpkit.data.entry import DatasetEntry, DataSpec, Splits
from ddpkit.data.text import tokens
from ddpkit.errors import UserError, first_line
from ddpkit.registry import Registry

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from ddpkit.config import Config

ENTRY_POINT_GROUP = "ddpkit.datasets"
__all__ = [
    "DataSpec",
    "DatasetEntry",
    "Splits",
    "build_datasets",
    "check_available",
    "dataset_names",
    "get_dataset",
    "register_dataset",
]


def _builtin_entries() -> list[DatasetEntry]:
    """The built-in entries, in the order their names are listed; their modules are imported when the registry is
    first used, not with it (a config that names a registered data set loads none of them)."""
    return [*builtin.ENTRIES, *text.ENTRIES, *vision.ENTRIES, *tokens.ENTRIES]


_REGISTRY: Registry[DatasetEntry] = Registry(
    "data set", ENTRY_POINT_GROUP, DatasetEntry, "ddpkit.data.DatasetEntry", builtins=_builtin_entries
)


def register_dataset(entry: DatasetEntry, *, replace: bool = False) -> DatasetEntry:
    """Make `entry.name` a valid data.dataset; refuses to shadow a registered name unless replace=True."""
    return _REGISTRY.register(entry, replace=replace)


def dataset_names() -> list[str]:
    """Every registered data set name (built-in ones first)."""
    return list(_REGISTRY)


def get_dataset(name: str) -> DatasetEntry:
    """The entry for data.dataset `name`; UserError naming the closest valid one when there is none."""
    return _REGISTRY.get(name, "data.dataset")


@check_with
def _check_name(cfg: Config) -> None:
    """At load: data.dataset is a registered data set (built in, registered, or an installed package's)."""
    get_dataset(cfg.data.dataset)


def check_available(cfg: Config) -> None:
    """Raise UserError when cfg.data's data set cannot be loaded; looks at files only, loads nothing."""
    entry = get_dataset(cfg.data.dataset)
    if entry.check is not None:
        entry.check(cfg)


# What reading a damaged or foreign file raises inside torchvision and numpy.
_READ_ERRORS = (
    OSError,
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    EOFError,
    AssertionError,
    pickle.UnpicklingError,
)


def _load_error(entry: DatasetEntry, cfg: Config, e: BaseException) -> UserError:
    """A one-line UserError for a failed download or an unreadable file."""
    root = cfg.data.root
    if isinstance(e, safe_pickle.CodeRefused):  # the file and what it asked to run, nothing cut
        return UserError(str(e), "replace it with the data set's own file")
    detail = f"{type(e).__name__}: " + first_line(e, limit=50, joined=True)
    if cfg.data.download and entry.downloads and entry.missing is not None and entry.missing(root):
        return UserError(
            f"downloading {entry.title} into data.root '{root}' failed: {detail}",
            f"check the network, or put them there as {entry.layout} with data.download=false",
        )
    return UserError(
        f"cannot read the {entry.title} data under data.root '{root}': {detail}",
        f"the files are damaged or not laid out as {entry.layout}; replace them",
    )


def _labels_present(ds: Dataset) -> int:
    """1 + the largest label of a torchvision-style data set (0 when unknown or empty)."""
    targets: Any = getattr(ds, "targets", None)
    if targets is None:
        targets = getattr(ds, "labels", None)
    if targets is None or len(targets) == 0:
        return 0
    import torch

    return int(torch.as_tensor(targets).max().item()) + 1


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset, DataSpec]:
    """(train set, augmented when cfg.data.augment; val set, never augmented; DataSpec) for cfg.data; sets read
    from files come wrapped so that an undecodable sample is a one-line error or, with data.skip_corrupt, skipped."""
    from ddpkit.distributed.collectives import rank_zero_first

    entry = get_dataset(cfg.data.dataset)
    check_available(cfg)
    try:
        if entry.downloads and cfg.data.download:
            with rank_zero_first():  # rank 0 downloads and unpacks, the others wait and then read
                splits = entry.build(cfg)
        else:
            splits = entry.build(cfg)
    except UserError:
        raise
    except _READ_ERRORS as e:
        if not entry.layout:  # the entry reads no files of the user's: a bug, not a user error
            raise
        raise _load_error(entry, cfg, e) from None
    present = max(splits.num_classes, _labels_present(splits.train), _labels_present(splits.val))
    want = cfg.model.num_classes
    if want is not None and want < present and splits.vocab_size is None:
        raise UserError(
            f"model.num_classes={want} but the {entry.title} data has {present} classes",
            f"set model.num_classes={present} or leave it unset (null) to take it from the data",
        )
    from ddpkit.data.checked import checked

    skip = cfg.data.skip_corrupt
    train, val = checked(splits.train, "training", skip), checked(splits.val, "validation", skip)
    spec = DataSpec(
        num_classes=present,
        in_channels=splits.in_channels,
        image_size=splits.image_size,
        train_size=len(splits.train),  # type: ignore[arg-type]
        val_size=len(splits.val),  # type: ignore[arg-type]
        vocab_size=splits.vocab_size,
        block_size=cfg.data.block_size if splits.vocab_size is not None else None,
        tokenizer=splits.tokenizer,
    )
    return train, val, spec
