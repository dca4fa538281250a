"""In-memory and generated image data sets (torch tensors): what the built-in digits and synthetic entries build.

Both hand a DataLoader whole batches: `__getitems__` (the DataLoader's batched fetch) returns a `Collated` batch,
already stacked, which `collate` (their `ddpkit_collate`, the collate_fn ddpkit's loaders give them) passes on
as it is: no per-sample tensors unbound and stacked again, no labels read into Python numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from ddpkit.distributed.collectives import derive_seed

# Generated sets up to this many bytes of images are made once, when built; larger ones on each access.
SYNTHETIC_MADE_ONCE_BYTES = 1 << 30


class Collated(list):
    """[images, labels] of a whole batch, stacked already (what `__getitems__` of these sets returns)."""


def collate(batch):
    """collate_fn for these sets: a Collated batch as it is, anything else through torch's default_collate."""
    return list(batch) if isinstance(batch, Collated) else default_collate(batch)


def random_shift(x: torch.Tensor, pad: int, flip: bool = False) -> torch.Tensor:
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


def batch_shift(x: torch.Tensor, pad: int, flip: bool = False) -> torch.Tensor:
    """random_shift of every image of a batch (N x C x H x W), each its own offset and flip, drawn from the
    same random stream in the same order as N calls of random_shift (so both give the same images)."""
    n, h, w = len(x), x.shape[-2], x.shape[-1]
    r = torch.randint(0, 2 * pad + 1, (n, 3))
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (r[:, 0, None] + torch.arange(h))[:, :, None]  # N x H x 1: the window's rows in `padded`
    cols = (r[:, 1, None] + torch.arange(w))[:, None, :]  # N x 1 x W
    out = padded[torch.arange(n)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)  # N x C x H x W
    if flip:
        out = torch.where((r[:, 2] % 2 == 1)[:, None, None, None], out.flip(-1), out)
    return out.contiguous()


class TensorImageDataset(Dataset):
    """In-memory images (N x C x H x W, float in [0, 1]) with labels: optional shift/flip, resize, normalise.

    Without a shift (whose zero padding must come before the normalisation) the images are normalised and resized
    once, here: an access only indexes (and flips).
    """

    ddpkit_collate = staticmethod(collate)
    batched = (
        False  # set by ddpkit's loaders, whose collate takes stacked batches; a plain DataLoader gets samples
    )

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
        self.labels = labels
        self.mean, self.std = float(mean), float(std)
        self.shift, self.flip, self.size = shift, flip, size
        self.prepared = not shift  # normalised (and resized) once: an access only indexes and flips
        if self.prepared:
            images = self._resize((images - self.mean) / self.std)
        self.images = images

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        if self.size and self.size != x.shape[-1]:
            return F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return x

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index]
        if self.shift:
            x = random_shift(x, self.shift, self.flip)
        elif self.flip and torch.rand(()).item() < 0.5:
            x = x.flip(-1)
        if not self.prepared:
            x = (self._resize(x[None])[0] - self.mean) / self.std
        return x, int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> Collated:
        """A whole batch at once (the DataLoader's batched fetch): the same transforms as __getitem__ on a
        tensor of samples, a few operations per batch instead of per sample; stacked already."""
        if not self.batched:  # a plain DataLoader: samples, for its default_collate
            return [self[i] for i in indices]
        x = self.images[indices]
        if self.shift:
            x = batch_shift(x, self.shift, self.flip)
        elif self.flip:
            x = torch.where((torch.rand(len(x)) < 0.5)[:, None, None, None], x.flip(-1), x)
        if not self.prepared:
            x = (self._resize(x) - self.mean) / self.std
        return Collated([x, self.labels[indices]])


class SyntheticImages(Dataset):
    """A learnable synthetic set: a smooth per-class pattern plus per-index noise.

    Everything derives from `seed`: the class patterns (shared by both splits), the labels and each
    image's noise (a generator seeded per (seed, split, index)). A set of up to SYNTHETIC_MADE_ONCE_BYTES is
    made once, here (a step then measures the model, not the generator); a larger one is generated on each
    access (memory O(classes + N)), the same images either way.
    """

    ddpkit_collate = staticmethod(collate)
    batched = (
        False  # set by ddpkit's loaders, whose collate takes stacked batches; a plain DataLoader gets samples
    )

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
        self.images: torch.Tensor | None = None
        if self.n * 3 * self.image_size**2 * 4 <= SYNTHETIC_MADE_ONCE_BYTES:
            self.images = torch.stack([self._generate(i) for i in range(self.n)]) if self.n else None

    def _generate(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(self.seed, 7003, self.split, index))
        noise = torch.randn(3, self.image_size, self.image_size, generator=g)
        return self.patterns[int(self.labels[index])] + self.noise * noise

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        x = self.images[index] if self.images is not None else self._generate(index)
        if self.augment:
            x = random_shift(x, max(1, self.image_size // 8), flip=True)
        return x, int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> Collated:
        """A whole batch at once, stacked (augmentation: batch_shift, the same stream as sample by sample)."""
        if not self.batched:  # a plain DataLoader: samples, for its default_collate
            return [self[i] for i in indices]
        if self.images is None or any(not 0 <= i < self.n for i in indices):
            return Collated(default_collate([self[i] for i in indices]))
        x = self.images[indices]
        if self.augment:
            x = batch_shift(x, max(1, self.image_size // 8), flip=True)
        return Collated([x, self.labels[indices]])
