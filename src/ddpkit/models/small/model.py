"""The built-in small models (`model.arch=cnn`, `mlp`): sized by the data's classes, channels and image size."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddpkit.models.family import ModelFamily
from ddpkit.models.small.keys import CARD, NAMES


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU blocks, global average pool, linear head; for 8x8 digits up to 224px images.

    The strides (and an optional parameter-free max pool) follow `image_size`, so the state_dict keys are the
    same for every input size: small inputs (<= 32px) keep full resolution in the first block.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, widths=(32, 64, 128)):
        super().__init__()
        w1, w2, w3 = widths
        first_stride = 1 if image_size <= 32 else 2
        self.block1 = _conv_bn_relu(in_channels, w1, first_stride)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1) if image_size > 64 else nn.Identity()
        self.block2 = _conv_bn_relu(w1, w2, 2)
        self.block3 = _conv_bn_relu(w2, w3, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        x = self.block3(self.block2(self.pool1(self.block1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_mlp(num_classes: int, in_channels: int, image_size: int, hidden=(256, 128)) -> nn.Sequential:
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> Linear; no normalisation, no dropout (exactly reproducible)."""
    h1, h2 = hidden
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, h1),
        nn.ReLU(),
        nn.Linear(h1, h2),
        nn.ReLU(),
        nn.Linear(h2, num_classes),
    )


BUILTIN: dict[str, Callable[[int, int, int], nn.Module]] = dict(
    zip(NAMES, (SmallCNN, build_mlp), strict=True)
)


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=lambda arch, n, c, size: BUILTIN[arch](n, c, size),
    names=lambda: list(BUILTIN),
    order=100,
)
