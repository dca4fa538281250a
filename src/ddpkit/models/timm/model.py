"""timm's models (`model.arch=timm:NAME`); timm is imported only when such a model is asked for."""

from __future__ import annotations

import difflib
from typing import Any

from torch import nn

from ddpkit.errors import UserError
from ddpkit.models.family import ModelFamily
from ddpkit.models.timm.keys import CARD
from ddpkit.models.timm.keys import PREFIX as TIMM_PREFIX


def _import_timm() -> Any:
    try:
        import timm
    except ImportError:
        raise UserError(
            "model.arch timm:... needs the timm package, which is not installed",
            "pip install timm (or pip install 'ddpkit[timm]')",
        ) from None
    return timm


def _check_timm(arch: str) -> None:
    timm, name = _import_timm(), arch[len(TIMM_PREFIX) :]
    if not name:
        raise UserError("model.arch 'timm:' names no model", "write e.g. model.arch=timm:resnet18")
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, list(timm.list_models()), n=1, cutoff=0.5)
    hint = f"did you mean 'timm:{close[0]}'?" if close else "see timm.list_models() for the names"
    raise UserError(f"unknown timm model '{name}' in model.arch", hint)


def _build_timm(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    name = arch[len(TIMM_PREFIX) :]  # checked by _check_timm first
    return _import_timm().create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels)


FAMILY = ModelFamily(
    **CARD.fields(),
    owns=CARD.owns,
    build=_build_timm,
    check=_check_timm,
    order=400,
)
