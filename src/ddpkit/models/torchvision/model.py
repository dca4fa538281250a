"""torchvision's classification models (`model.arch=resnet18`, ...) and their pretrained weights
(`model.pretrained=torchvision`); torchvision is imported only when such a model is asked for."""

from __future__ import annotations

import os

import torch
from torch import nn

from ddpkit.errors import UserError, first_line
from ddpkit.models.family import ModelFamily
from ddpkit.models.torchvision.keys import CARD


def torchvision_names() -> list[str]:
    """torchvision's classification model names."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _repeat_gray_to_rgb(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: a 1-channel image batch becomes 3 identical channels (torchvision stems expect RGB)."""
    x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == 1:
        return (x.repeat(1, 3, 1, 1), *args[1:])
    return None


def _build_torchvision(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    import torchvision

    if in_channels not in (1, 3):
        raise UserError(
            f"torchvision model '{arch}' takes 3-channel (or 1-channel, repeated) images, the data has {in_channels}",
            "use model.arch=cnn or mlp, or timm:NAME (which adapts the first layer)",
        )
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if in_channels == 1:
        # Parameter-free: the state_dict keys stay torchvision's, so its pretrained weights still load.
        model.register_forward_pre_hook(_repeat_gray_to_rgb)
    return model


def pretrained_weights(arch: str) -> dict[str, torch.Tensor]:
    import torchvision

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        return weights.get_state_dict(progress=False, check_hash=False)
    except OSError as e:  # URLError, socket errors, a read-only cache directory
        hub = os.path.join(torch.hub.get_dir(), "checkpoints")
        raise UserError(
            f"cannot download torchvision's {arch} weights ({first_line(getattr(e, 'reason', e), 40)})",
            f"download {weights.url} elsewhere and give it as model.pretrained=PATH, or put it in {hub}",
        ) from None


def resnet_splits(arch: str, n_stages: int) -> list[str]:
    """Where a ResNet's pipeline stages begin: its residual stages layer2..layer4, evenly chosen (torch's tracer
    cuts it there); the other torchvision models have no split."""
    if not arch.startswith("resnet"):
        raise UserError(
            f"model.arch={arch} has no pipeline split",
            "dist.pp>1 cuts a torchvision ResNet at its residual stages; for your own model use "
            "ddpkit.prepare(model, pp=..., pp_split=[module names])",
        )
    points = {2: ["layer3"], 3: ["layer2", "layer4"], 4: ["layer2", "layer3", "layer4"]}
    if n_stages not in points:
        raise UserError(
            f"a ResNet is cut at its residual stages into 2, 3 or 4 pipeline stages, not {n_stages}",
            "use dist.pp=2 (or 3, 4 with dist.pp_schedule=gpipe or 1f1b)",
        )
    return points[n_stages]


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=lambda arch: arch in torchvision_names(),
    build=_build_torchvision,
    names=torchvision_names,
    torchvision_weights=True,
    pp_split=resnet_splits,
    order=500,
)
