"""In-memory and generated image data sets (torch tensors): what the built-in digits and synthetic entries build."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ddpkit.distributed.collectives import derive_seed


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
            x = random_shift(x, self.shift, self.flip)
        elif self.flip and torch.rand(()).item() < 0.5:
            x = x.flip(-1)
        if self.size and self.size != x.shape[-1]:
            x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        return (x - self.mean) / self.std, int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A whole batch at once (the DataLoader's batched fetch): the same transforms as __getitem__ on a
        tensor of samples, a few operations per batch instead of per sample."""
        x = self.images[indices]
        if self.shift:
            x = batch_shift(x, self.shift, self.flip)
        elif self.flip:
            x = torch.where((torch.rand(len(x)) < 0.5)[:, None, None, None], x.flip(-1), x)
        if self.size and self.size != x.shape[-1]:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = (x - self.mean) / self.std
        return list(zip(x.unbind(0), self.labels[indices].tolist(), strict=True))


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
            x = random_shift(x, max(1, self.image_size // 8), flip=True)
        return x, y
