"""Samples decoded from the user's files: an undecodable one is an error naming its file, or (data.skip_corrupt)
it is left out of its batch, counted and named."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from ddpkit.data.tensor_sets import SyntheticImages, TensorImageDataset
from ddpkit.distributed.collectives import gather_object_to
from ddpkit.errors import UserError, first_line


def _decode_errors() -> tuple[type[BaseException], ...]:
    """What decoding a damaged file raises: OSError (unidentified or truncated images, I/O errors), SyntaxError
    (broken PNG chunks), ValueError, EOFError, and PIL's decompression bomb guard."""
    errors: list[type[BaseException]] = [OSError, SyntaxError, ValueError, EOFError]
    try:
        from PIL import Image

        errors.append(Image.DecompressionBombError)
    except ImportError:
        pass
    return tuple(errors)


DECODE_ERRORS = _decode_errors()
SKIP_HINT = "replace the file, or set data.skip_corrupt=true to leave such samples out"


class CorruptSample(UserError):
    """An undecodable sample (exit 2, one line naming the file), also when a DataLoader worker met it."""

    def __init__(self, what: str, hint: str | None = None):
        if hint is None and "Traceback" in what:  # rebuilt from a worker's traceback: its last line is ours
            what = what.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(what, hint)


class CheckedSamples(Dataset):
    """`inner` with its decoding failures made one-line errors, or (skip) samples that come back as None and
    are marked in a bitmap shared with the loader's worker processes. Other attributes are inner's."""

    def __init__(self, inner: Dataset, split: str, skip: bool):
        self.inner, self.split, self.skip = inner, split, skip
        size = len(inner)  # type: ignore[arg-type]
        self.bad = torch.zeros(size, dtype=torch.bool).share_memory_() if skip else None

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def where(self, i: int) -> str:
        """`file 'PATH'` of sample i when the data set lists its files (torchvision's `samples`), else `sample i`."""
        samples = getattr(self.inner, "samples", None)
        try:
            path = samples[i][0] if samples is not None else None
        except (IndexError, KeyError, TypeError):
            path = None
        return f"file '{path}'" if isinstance(path, str) else f"sample {i}"

    def __getitem__(self, i: int) -> Any:
        try:
            return self.inner[i]
        except DECODE_ERRORS as e:
            if self.bad is None:
                text = first_line(re.sub(r"<_io\.\w+ name=[^>]*>", "it", str(e)), limit=80)
                reason = f"{type(e).__name__}: {text}"
                raise CorruptSample(
                    f"cannot decode {self.where(i)} of the {self.split} set ({reason})", SKIP_HINT
                ) from None
            self.bad[i] = True
            return None

    def first_decodable(self, limit: int = 1000) -> Any:
        """The first sample that decodes (among the first `limit`); CorruptSample when none does."""
        for i in range(min(limit, len(self))):
            sample = self[i]
            if sample is not None:
                return sample
        raise CorruptSample(
            f"none of the first {min(limit, len(self))} samples of the {self.split} set decodes "
            f"(the first: {self.where(0)})",
            "check data.root and the files' format",
        )

    def take_skipped(self) -> list[str]:
        """The samples left out since the last call (as where() names them); forgets them."""
        if self.bad is None:
            return []
        found = self.bad.nonzero().flatten().tolist()
        self.bad.zero_()
        return [self.where(i) for i in found]


class SkipCollate:
    """collate_fn that leaves out skipped samples; a batch of nothing else becomes one decodable sample (`fill`:
    training, so that every rank still takes its step) or an empty batch (evaluation scores nothing twice)."""

    def __init__(self, dataset: CheckedSamples, fill: bool):
        self.dataset: CheckedSamples | None = dataset
        self.fill = fill

    def __getstate__(self) -> dict[str, Any]:  # a worker has its own copy of the data set (get_worker_info)
        return {"dataset": None, "fill": self.fill}

    def __call__(self, batch: list[Any]) -> Any:
        kept = [s for s in batch if s is not None]
        if kept:
            return default_collate(kept)
        info = get_worker_info()
        dataset = self.dataset if self.dataset is not None else info.dataset  # type: ignore[union-attr]
        one = default_collate([dataset.first_decodable()])
        return one if self.fill else [t[:0] for t in one]


def checked(ds: Dataset, split: str, skip: bool) -> Dataset:
    """`ds` wrapped in CheckedSamples, unless its samples live in memory (nothing there to decode)."""
    if isinstance(ds, (TensorImageDataset, SyntheticImages, CheckedSamples)) or getattr(
        ds, "in_memory", False
    ):
        return ds
    return CheckedSamples(ds, split, skip)


def check_decodable(train: Dataset, val: Dataset) -> None:
    """The first sample of each set decodes (with data.skip_corrupt: some early sample does); else CorruptSample."""
    for ds in (train, val):
        if isinstance(ds, CheckedSamples) and len(ds):
            if ds.skip:
                ds.first_decodable()
                ds.take_skipped()  # a check, not training: nothing was left out yet
            else:
                ds[0]


def skipped_in_epoch(train: Dataset, val: Dataset, epoch: int, warn: Callable[[str], None]) -> int:
    """Samples left out since the last call over all ranks (collective when data.skip_corrupt, else 0); warn()
    names them on rank 0."""
    sets = [ds for ds in (train, val) if isinstance(ds, CheckedSamples) and ds.skip]
    if not sets:
        return 0
    names = [
        n for part in gather_object_to([n for ds in sets for n in ds.take_skipped()]) or [] for n in part
    ]
    if names:
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        warn(f"ddpkit: warning: epoch {epoch} left out {len(names)} undecodable sample(s): {shown}")
    return len(names)


def collate_for(ds: Dataset, training: bool) -> SkipCollate | None:
    """The collate_fn a loader over `ds` needs (None: the default)."""
    if isinstance(ds, CheckedSamples) and ds.skip:
        return SkipCollate(ds, fill=training)
    return None
